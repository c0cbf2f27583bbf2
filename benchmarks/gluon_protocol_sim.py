"""Model of gluon_backward.py's mbarrier protocol (ready/empty per stage), to check trip counts, parities and
stage reuse for every variant. Each side is a generator yielding blocking conditions; the scheduler runs random
interleavings and flags a deadlock or a stage overwritten while its readers are pending."""

import random


class Bar:
    def __init__(self):
        self.phase = 0  # completed phases
        self.pending = 1
        self.tx = 0

    def arrive(self):
        self.pending -= 1
        self._maybe()

    def expect(self, n):
        self.tx += n
        self.arrive()

    def complete_tx(self, n):
        self.tx -= n
        self._maybe()

    def _maybe(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = 1

    def passed(self, parity):  # try_wait.parity: the phase with this parity completed (current phase != parity)
        return (self.phase & 1) != parity


def run(total, S, ws, defer, seed):
    rnd = random.Random(seed)
    ready = [Bar() for _ in range(S)]
    empty = [Bar() for _ in range(S)]
    stage_of = {}  # stage -> iteration whose data it holds
    readers = {}  # stage -> iteration still reading it
    inflight = []  # pending TMA: (stage, iteration)
    errors = []

    def issue(t):
        if t >= total:
            return
        s = t % S
        if s in readers:
            errors.append(f"TMA for t={t} into stage {s} while iteration {readers[s]} reads it")
        ready[s].expect(1)
        inflight.append((s, t))

    def loader():
        for t in range(total):
            s = t % S
            par = ((t // S) & 1) ^ 1
            while not empty[s].passed(par):
                yield
            issue(t)
            yield

    def consumer():
        if not ws:
            for i in range(S - 1):
                issue(i)
        prev = None
        for t in range(total):
            s = t % S
            if not ws and not defer:
                issue(t + S - 1)
            while not ready[s].passed((t // S) & 1):
                yield
            if stage_of.get(s) != t:
                errors.append(f"t={t} read stage {s} holding {stage_of.get(s)}")
            readers[s] = t
            yield
            if defer:
                if prev is not None:
                    readers.pop(prev % S, None)  # the tile before's dV/dK waited for
                if ws:
                    if t > 0:
                        empty[(t + S - 1) % S].arrive()
                else:
                    issue(t + S - 1)
                yield
                prev = t
            else:
                readers.pop(s, None)
                if ws:
                    empty[s].arrive()
                yield
        if defer and prev is not None:
            readers.pop(prev % S, None)

    procs = [consumer()] + ([loader()] if ws else [])
    alive = list(procs)
    steps = 0
    while alive or inflight:
        steps += 1
        if steps > 100000:
            return ["deadlock"]
        choice = rnd.random()
        if inflight and (choice < 0.3 or not alive):
            s, t = inflight.pop(rnd.randrange(len(inflight)))
            stage_of[s] = t
            ready[s].complete_tx(1)
            continue
        if not alive:
            continue
        p = rnd.choice(alive)
        try:
            next(p)
        except StopIteration:
            alive.remove(p)
    return errors


bad = 0
for ws in (False, True):
    for defer in (False, True):
        for S in (2, 3):
            for total in range(0, 9):
                for seed in range(40):
                    e = run(total, S, ws, defer, seed)
                    if e:
                        bad += 1
                        print(ws, defer, S, total, seed, e[:2])
                        break
print("bad", bad)
