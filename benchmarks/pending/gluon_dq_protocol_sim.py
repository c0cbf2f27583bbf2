"""Model of the Gluon dQ kernel's protocol (``kernels/hopper/gluon_dq.py``, parked in ``issue-14-gluon-dq.patch``):
the ``q_bar`` / ``ready`` / ``empty`` mbarriers with their expect-tx byte counts, the TMA ring, the two consumer
warpgroups with their async wgmma groups and ``wgmma.wait_group`` depths, the consumer-only ``bar.sync``s (the tile
max's two and the kernel's ``thread_barrier``s), the dS codes' shared tile (``-smem``) and the release of a stage
by one elected thread. A sibling of ``benchmarks/gluon_protocol_sim.py`` (the dK/dV kernel's), written by the dQ
kernel's offline review; it models the kernel as written, statement by statement, not the hardware.

Each warpgroup (and the load warp with ``ws``) is a generator that yields at every step and blocks on an mbarrier
parity or a named barrier; TMA copies land at random later times. A run fails on a deadlock, a TMA copy landing
in a buffer that a wgmma group not yet waited for reads, a wgmma reading a stage that holds another tile (or Q'^/dO
before they landed), codes stored while a dQ product reading them is in flight, a dQ product issued before both
warpgroups stored and fenced the tile's codes, expect-tx bytes that differ from the copies' bytes, or a copy still
in flight at the end. wgmma groups are modelled as reading their operands until the wait that retires them (the
latest the hardware may read), which is the conservative side.

    python benchmarks/pending/gluon_dq_protocol_sim.py     # prints "bad 0" when every interleaving passes
"""

from __future__ import annotations

import random
import sys

#: Bytes of one stage's copies at D=128 (K'^ [64, 128] int8, K'^T [128, 64] int8, V [64, 128] bf16 in two 128-byte
#: wide boxes) and of Q'^ [128, 128] int8 + dO [128, 128] bf16 (two boxes); the expect-tx values in the compiled PTX
#: are 32768 and 49152.
STAGE_COPIES = (("k", 8192), ("kt", 8192), ("v", 8192), ("v", 8192))
STAGE_EXPECT = 32768
Q_COPIES = (("q", 16384), ("do", 16384), ("do", 16384))
Q_EXPECT = 49152


class MBarrier:
    """``mbarrier`` with arrival count 1 and a transaction count."""

    def __init__(self) -> None:
        self.phase = 0  # completed phases
        self.pending = 1
        self.tx = 0

    def arrive(self) -> None:
        self.pending -= 1
        self._maybe()

    def expect(self, nbytes: int) -> None:  # mbarrier.arrive.expect_tx
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe()

    def _maybe(self) -> None:
        if self.pending < 0:
            raise AssertionError("more arrivals than the count")
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = 1

    def passed(self, parity: int) -> bool:  # try_wait.parity returns when the phase of this parity has completed
        return (self.phase & 1) != parity


class NamedBarrier:
    """``bar.sync id, 256`` over the two consumer warpgroups."""

    def __init__(self, parties: int) -> None:
        self.parties, self.count, self.generation = parties, 0, 0

    def sync(self):
        gen = self.generation
        self.count += 1
        if self.count == self.parties:
            self.count, self.generation = 0, self.generation + 1
        while self.generation == gen:
            yield


def run(n_tiles: int, stages: int, ws: bool, defer: bool, smem: bool, seed: int, issuer: int = 0) -> list[str]:
    rnd = random.Random(seed)
    ready = [MBarrier() for _ in range(stages)]
    empty = [MBarrier() for _ in range(stages)]
    q_bar = MBarrier()
    bar = NamedBarrier(2)
    holds: dict[tuple, object] = {}  # buffer -> what landed there last ("q", or the key tile)
    inflight: list[tuple] = []  # TMA copies: (buffer, content, bytes, barrier)
    groups: list[list[tuple]] = [[], []]  # per warpgroup: its wgmma groups not yet waited for (buffers read)
    codes = {"stored": [-1, -1], "fenced": [-1, -1]}
    errors: list[str] = []
    loaded: list[int] = []

    def copy(buffer: tuple, content: object, nbytes: int, barrier: MBarrier) -> None:
        inflight.append((buffer, content, nbytes, barrier))

    def issue_q() -> None:
        q_bar.expect(Q_EXPECT)
        for name, nbytes in Q_COPIES:
            copy((name,), "q", nbytes, q_bar)
        if sum(n for _, n in Q_COPIES) != Q_EXPECT:
            errors.append("q_bar: expect-tx differs from the copies' bytes")

    def issue_kv(t: int) -> None:  # _issue_kv: predicated off past the last tile
        if t >= n_tiles:
            return
        s = t % stages
        ready[s].expect(STAGE_EXPECT)
        for name, nbytes in STAGE_COPIES:
            copy((name, s), t, nbytes, ready[s])
        loaded.append(t)

    def mma(wg: int, reads: list[tuple], want: dict) -> None:
        for buffer in reads:
            if holds.get(buffer) != want[buffer[0]]:
                errors.append(f"wg{wg}: wgmma reads {buffer} holding {holds.get(buffer)}, wants {want[buffer[0]]}")
        groups[wg].append(reads)

    def wait(wg: int, outstanding: int) -> None:  # wgmma.wait_group: all but the newest `outstanding` retire
        del groups[wg][: max(0, len(groups[wg]) - outstanding)]

    def loader():
        issue_q()
        yield
        for t in range(n_tiles):
            while not empty[t % stages].passed(((t // stages) & 1) ^ 1):
                yield
            issue_kv(t)
            yield

    def consumer(wg: int):
        if not ws and wg == issuer:
            issue_q()
            for i in range(stages - 1):
                issue_kv(i)
        yield
        while not q_bar.passed(0):
            yield
        for t in range(n_tiles):
            s = t % stages
            if not ws and not defer and wg == issuer:
                issue_kv(t + stages - 1)
                yield
            while not ready[s].passed((t // stages) & 1):
                yield
            tile = {"q": "q", "do": "q", "k": t, "v": t, "kt": t, "ds": t}
            mma(wg, [("q",), ("k", s)], tile)  # S
            yield
            mma(wg, [("do",), ("v", s)], tile)  # dP
            yield
            if defer:
                wait(wg, 2)  # the tile before's dQ product
                yield
                yield from bar.sync()
                if wg == 0 and ws and t > 0:  # the elected thread of the partition
                    empty[(t + stages - 1) % stages].arrive()
                if not ws and wg == issuer:
                    issue_kv(t + stages - 1)
                yield
            wait(wg, 1)  # S
            yield
            wait(wg, 0)  # dP
            yield
            yield from bar.sync()  # the tile max across both warpgroups: two bar.sync
            yield from bar.sync()
            if smem:
                if any(("ds",) in g for w in (0, 1) for g in groups[w]):
                    errors.append(f"wg{wg}: codes of tile {t} stored while a dQ product reads the tile before's")
                codes["stored"][wg] = t
                yield
                codes["fenced"][wg] = codes["stored"][wg]  # fence.proxy.async
                yield
                yield from bar.sync()
                if codes["fenced"] != [t, t]:
                    errors.append(f"wg{wg}: dQ product of tile {t} issued before both codes were fenced")
                holds[("ds",)] = t
                mma(wg, [("kt", s), ("ds",)], tile)
            else:
                mma(wg, [("kt", s)], tile)  # the codes from registers
            yield
            if not defer:
                wait(wg, 0)
                yield
                yield from bar.sync()
                if wg == 0 and ws:
                    empty[s].arrive()
                yield
        if defer:
            wait(wg, 0)
        yield

    procs = [consumer(0), consumer(1)] + ([loader()] if ws else [])
    alive = list(procs)
    steps = 0
    while alive or inflight:
        steps += 1
        if steps > 200000:
            return errors + ["deadlock (step limit: every process waits on a barrier)"]
        runnable = bool(alive)
        if inflight and (rnd.random() < 0.3 or not runnable):
            buffer, content, nbytes, barrier = inflight.pop(rnd.randrange(len(inflight)))
            readers = [w for w in (0, 1) for g in groups[w] if buffer in g]
            if readers:
                errors.append(f"TMA of {content} lands in {buffer} while wg{readers[0]}'s wgmma reads it")
            holds[buffer] = content
            barrier.complete_tx(nbytes)
            continue
        if not alive:
            continue
        p = rnd.choice(alive)
        try:
            next(p)
        except StopIteration:
            alive.remove(p)
    if sorted(loaded) != list(range(n_tiles)):
        errors.append(f"tiles loaded {sorted(loaded)}")
    if any(groups):
        errors.append("wgmma groups never waited for")
    return errors


def main() -> int:
    bad = runs = 0
    for ws in (False, True):
        for defer in (False, True):
            for smem in (False, True):
                for stages in (2, 3, 4, 5):
                    for n_tiles in range(1, 11):
                        for seed in range(25):
                            runs += 1
                            errors = run(n_tiles, stages, ws, defer, smem, seed, issuer=seed % 2)
                            if errors:
                                bad += 1
                                print(f"ws={ws} defer={defer} smem={smem} stages={stages} tiles={n_tiles} "
                                      f"seed={seed}: {errors[:2]}")  # fmt: skip
                                break
    # The one depth the wrapper must refuse: -defer releases a stage one tile late, so one stage deadlocks.
    for ws in (False, True):
        print(f"stages=1 defer ws={ws}:", run(3, 1, ws, True, False, 0)[:1])
    print(f"runs {runs} bad {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
