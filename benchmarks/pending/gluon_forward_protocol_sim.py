"""Model of the Gluon forward's mbarrier protocol (``kernels/hopper/gluon_forward.py`` in
``issue-14-gluon-forward.patch``): the load warp, the two consumer warpgroups and their ping-pong hand-off, with
the TMA copies and the async wgmma as separate actors that finish at random times. Random interleavings check:
no deadlock, every wgmma reads the tile it was meant to (the ring stage holds that tile, the codes buffer holds
that tile's codes), no TMA copy lands in a stage while a wgmma still reads it, no codes written while a wgmma
still reads them, the turns strictly alternate (with ``pingpong``), and every expect-tx count is met.

A model, not the kernel: each warpgroup is one actor (the kernel's ``bar.sync`` before every single-thread arrive
keeps its four warps within one step of each other; checked in the PTX, not here), mbarriers are modeled by
their completed-phase count and ``try_wait.parity`` by the parity of that count, as the hardware does.

    python benchmarks/pending/gluon_forward_protocol_sim.py      # prints "bad 0" when every run is clean

The last block shows what the kernel must not be given: zero key tiles (Nk = 0; the wrapper refuses it) hangs at
the first ``ready`` wait, and warpgroups with different tile counts hang at the hand-off (the kernel gives both
warpgroups the program's count).
"""

from __future__ import annotations

import random

K_BOX, V_BOX, Q_BOX = 3, 5, 7  # bytes of one TMA box (any distinct values): the whole box, also past the tensor's end


class Bar:
    """An mbarrier: ``count`` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self, count: int) -> None:
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the count in one phase"
        self._maybe()

    def expect(self, nbytes: int) -> None:  # mbarrier.arrive.expect_tx
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._maybe()

    def _maybe(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:  # try_wait.parity: the phase of this parity has completed
        return (self.phase & 1) != parity


def run(n_tiles: tuple[int, int], stages: int, pingpong: bool, seed: int, max_steps: int = 200_000) -> list[str]:
    rnd = random.Random(seed)
    ready = [Bar(1) for _ in range(stages)]
    empty = [Bar(2) for _ in range(stages)]
    q_bar = Bar(1)
    turn = [Bar(1), Bar(1)]
    k_holds, v_holds = {}, {}  # stage -> key tile whose K'^ / V^T has landed there
    p_holds = {}  # warpgroup -> key tile whose codes its shared-memory buffer holds
    readers = []  # (kind, stage or warpgroup, tile, warpgroup) read by an in-flight wgmma
    tma = []  # in-flight copies: (kind, stage, tile, bar, nbytes)
    wgmma = [[], []]  # per warpgroup, in issue order: (name, reads); they complete in order
    turns_taken = []
    errors = []

    def land(kind, stage, tile):
        for r_kind, r_where, r_tile, r_wg in readers:
            if r_kind == kind and r_where == stage:
                errors.append(
                    f"{kind} of tile {tile} lands in stage {stage} while WG{r_wg}'s wgmma reads tile {r_tile}"
                )

    def issue_copy(kind, stage, tile, bar, nbytes):
        land(kind, stage, tile)  # the copy may write any time from its issue on
        tma.append((kind, stage, tile, bar, nbytes))

    def issue_mma(wg, name, reads):
        for kind, where, tile in reads:
            holds = {"k": k_holds, "v": v_holds, "p": p_holds}[kind].get(where)
            if holds != tile:
                errors.append(f"WG{wg} {name} reads {kind}[{where}] = tile {holds}, wants tile {tile}")
            readers.append((kind, where, tile, wg))
        wgmma[wg].append((name, reads))

    def wait_mma(wg, outstanding):
        while len(wgmma[wg]) > outstanding:
            yield

    def write_codes(wg, tile):
        if any(r[0] == "p" and r[1] == wg for r in readers):
            errors.append(f"WG{wg} writes tile {tile}'s codes while a wgmma reads tile {p_holds.get(wg)}'s")
        p_holds[wg] = tile

    def loader():
        q_bar.expect(2 * Q_BOX)
        for h in range(2):
            issue_copy("q", h, 0, q_bar, Q_BOX)
        yield
        for j in range(max(n_tiles)):
            s = j % stages
            while not empty[s].passed(((j // stages) & 1) ^ 1):
                yield
            ready[s].expect(K_BOX + V_BOX)
            issue_copy("k", s, j, ready[s], K_BOX)
            yield
            issue_copy("v", s, j, ready[s], V_BOX)
            yield

    def take_turn(wg, k):
        if pingpong:
            while not turn[wg].passed((k & 1) ^ (1 - wg)):
                yield
            turns_taken.append(wg)

    def pass_turn(wg):
        if pingpong:
            turn[1 - wg].arrive()

    def consumer(wg):
        n = n_tiles[wg]
        while not q_bar.passed(0):
            yield
        yield from take_turn(wg, 0)
        while not ready[0].passed(0):
            yield
        issue_mma(wg, "S0", [("k", 0, 0)])
        pass_turn(wg)
        yield
        yield from wait_mma(wg, 0)
        write_codes(wg, 0)
        yield
        for j in range(n - 1):
            nxt = (j + 1) % stages
            yield from take_turn(wg, j + 1)
            while not ready[nxt].passed(((j + 1) // stages) & 1):
                yield
            issue_mma(wg, f"S{j + 1}", [("k", nxt, j + 1)])
            yield
            issue_mma(wg, f"PV{j}", [("p", wg, j), ("v", j % stages, j)])
            pass_turn(wg)
            yield
            yield from wait_mma(wg, 1)  # S_{j+1}; softmax
            yield
            yield from wait_mma(wg, 0)  # P V of tile j
            empty[j % stages].arrive()
            yield
            write_codes(wg, j + 1)
            yield
        yield from take_turn(wg, n)
        issue_mma(wg, f"PV{n - 1}", [("p", wg, n - 1), ("v", (n - 1) % stages, n - 1)])
        pass_turn(wg)
        yield
        yield from wait_mma(wg, 0)

    alive = [consumer(0), consumer(1), loader()]
    steps = 0
    while alive or tma or any(wgmma):
        steps += 1
        if steps > max_steps:
            return errors + ["deadlock"]
        choice = rnd.random()
        if tma and (choice < 0.25 or not alive):
            kind, stage, tile, bar, nbytes = tma.pop(rnd.randrange(len(tma)))
            land(kind, stage, tile)
            {"k": k_holds, "v": v_holds}.get(kind, {})[stage] = tile
            bar.complete_tx(nbytes)
            continue
        busy = [wg for wg in (0, 1) if wgmma[wg]]
        if busy and (choice < 0.45 or not alive):
            wg = rnd.choice(busy)
            _, reads = wgmma[wg].pop(0)
            for kind, where, tile in reads:
                readers.remove((kind, where, tile, wg))
            continue
        if not alive:
            if tma or any(wgmma):
                continue
            break
        proc = rnd.choice(alive)
        try:
            next(proc)
        except StopIteration:
            alive.remove(proc)
    if pingpong and turns_taken != [w for _ in range(len(turns_taken) // 2) for w in (0, 1)]:
        errors.append(f"turns not alternating: {turns_taken[:12]}")
    for s in range(stages):
        if ready[s].tx or empty[s].tx:
            errors.append(f"stage {s}: transaction bytes left over")
    return errors


def main() -> int:
    bad = 0
    for pingpong in (True, False):
        for stages in (2, 3, 4):
            for n in range(1, 10):
                for seed in range(60):
                    errors = run((n, n), stages, pingpong, seed)
                    if errors:
                        bad += 1
                        print("BAD", pingpong, stages, n, seed, errors[:3])
                        break
    print("bad", bad)
    # What the kernel must not be given (expected to hang).
    for n_tiles in ((0, 0), (2, 3), (3, 2)):
        errors = run(n_tiles, 2, True, 0, max_steps=20_000)
        print(f"n_tiles {n_tiles} (not allowed): {'hangs' if 'deadlock' in errors else 'no hang'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
