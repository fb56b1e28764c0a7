"""Generation calls in flight on the engines while the trainer works: start, collect, survive engine deaths.

``InFlight`` keeps at most one ``generate`` call per engine (whole prompt groups each), so a weight
update sent to an engine waits behind at most the call it is running: requests in flight finish
on the old weights, and nothing is queued between the buckets of one update (the driver starts no
call while a sync runs). ``wait`` returns the chunks that finished, as ``Group``s of scored samples
with advantages. An engine that dies loses only its own chunk: the session restarts it and
resyncs the weights, and the chunk is generated again from the driver's copy (engines get copies,
so nothing half-filled comes back); each chunk is taken from exactly one successful call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tidal.errors import is_engine_death
from tidal.errors import ray_get as get
from tidal.rollout.buffer import Group
from tidal.rollout.orchestrate import finish_samples, make_rollout_samples, sampling_params
from tidal.rollout.rewards import score_samples
from tidal.rollout.types import Sample


@dataclass
class Chunk:
    engine: int
    actor: object
    serials: list[int]
    samples: list[Sample]
    seed: int
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Finished:
    """What ``wait`` collected: kept groups, serials dynamic sampling dropped, metrics of each chunk."""

    groups: list[Group] = field(default_factory=list)
    filtered: list[int] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    busy_s: float = 0.0  # engine-seconds of the collected calls


class InFlight:
    def __init__(self, s):
        self.s = s
        self.n = s.cfg.rollout.n_samples_per_prompt
        self.calls: dict = {}  # ray ref -> Chunk
        self.paused: list[Chunk] = []  # --partial-rollout: chunks a pause cut short, continued after the sync
        self.paused_groups = 0  # groups cut short since the last step line
        self.pausing: dict = {}  # engine -> the actor paused before this sync
        self.unanswered: set[int] = set()  # engines paused with a call out that answered neither pause nor health
        self.trainer_ahead = False  # the trainer trained since the last sync (a restart's resync is a new version)
        self.seed = s.cfg.rollout.rollout_seed
        self.window = time.perf_counter()  # engine busy time is counted from here (the step's start)

    def mark(self) -> None:
        """Start a new accounting window (each step): ``busy_s`` counts only engine time inside it."""
        self.window = time.perf_counter()

    def idle(self) -> list[int]:
        busy = {c.engine for c in self.calls.values()}
        return [i for i in range(len(self.s.engines)) if i not in busy]

    def groups_in_flight(self) -> int:
        return sum(len(c.serials) for c in (*self.calls.values(), *self.paused))

    def pause(self) -> None:
        """``--partial-rollout``, before a sync: every engine with a call out stops it at its next step
        boundary (``pause_generation``, answered beside the call); the calls come back with the rows they
        cut short ``aborted`` and are kept in ``paused`` by ``wait``."""
        import ray

        from tidal.rollout.orchestrate import _failed

        self.pausing = {c.engine: c.actor for c in self.calls.values()}
        pauses = {i: a.pause_generation.remote() for i, a in self.pausing.items()}
        # The health probe beside each pause (the probe group answers two at once): an engine that answers
        # neither within --engine-health-timeout hangs, and ``wait`` handles its call at once instead of
        # waiting that long again for the call and again for a probe (``unanswered``).
        probes = {i: a.health.remote() for i, a in self.pausing.items()}
        refs = [*pauses.values(), *probes.values()]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=self.s.cfg.rollout.engine_health_timeout)
        answered = set(answered)
        self.unanswered = {
            i for i in pauses if pauses[i] not in answered and (probes[i] not in answered or _failed(probes[i]))
        }

    def resume(self) -> None:
        """After the sync: the paused engines generate again, and every chunk cut short is sent back to its
        engine, to be continued from where it stopped on the new weights."""
        self.unanswered = set()
        for i, a in self.pausing.items():
            if a is self.s.engines.actors[i]:  # a restarted engine's new actor was never paused
                a.continue_generation.remote()  # in order before the generate below (same concurrency group)
        self.pausing = {}
        chunks, self.paused = self.paused, []
        for chunk in chunks:
            self._submit(chunk)

    def start(self, engine: int, prompts: list[tuple[int, tuple]]) -> None:
        """Generate the prompts ``[(serial, item)]`` (consecutive or not) on ``engine``; one call."""
        samples: list[Sample] = []
        for serial, item in prompts:
            samples += make_rollout_samples([item], self.n, start_index=serial * self.n)
        self.seed += 1
        self._submit(Chunk(engine, None, [p[0] for p in prompts], samples, self.seed))

    def _submit(self, chunk: Chunk) -> None:
        sampling = sampling_params(self.s.cfg.rollout, self.s.tokenizer)
        sampling.seed = chunk.seed
        chunk.started = time.perf_counter()
        chunk.actor = self.s.engines.actors[chunk.engine]
        self.calls[chunk.actor.generate.remote(chunk.samples, sampling)] = chunk

    def wait(self, also: list | None = None) -> Finished:
        """Block until a generate call (or one of the refs in ``also``) finishes; collect every finished call.

        While none finishes, the engines with a call out are probed every ``--engine-health-timeout``
        (``health``, answered beside the call: an HTTP engine's ``/health``): one that does not answer in
        time is hung, and its call is abandoned and handled as the call of an engine that died. An engine
        that answered neither its pause nor the probe beside it (``pause``) is hung already: once no call
        is ready, its call is handled so at once."""
        import ray

        out = Finished()
        timeout = self.s.cfg.rollout.engine_health_timeout
        while True:
            refs = list(self.calls) + list(also or [])
            if not refs:
                return out
            suspects = {
                c.engine for c in self.calls.values() if self.pausing.get(c.engine) is c.actor
            } & self.unanswered
            ready, _ = ray.wait(refs, num_returns=1, timeout=0 if suspects else timeout)
            if not self.calls:
                return out
            if ready:
                break
            hung = sorted(suspects) or self._hung(timeout)
            if hung:
                self.unanswered -= set(hung)
                what = "/health" if self.s.engines.kind == "sglang" else "health()"
                why = f"no {what} answer within {timeout:g} s (--engine-health-timeout)"
                self._revive([(self.calls.pop(r), why) for r, c in list(self.calls.items()) if c.engine in hung])
                return out
        ready, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
        dead: list[tuple[Chunk, str]] = []
        for ref in ready:
            chunk = self.calls.pop(ref)
            try:
                samples = get(ref)
            except Exception as e:  # noqa: BLE001 - only engine deaths are survived
                if not is_engine_death(e):
                    raise
                dead.append((chunk, str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__))
                continue
            now = time.perf_counter()
            out.busy_s += now - max(chunk.started, self.window)
            if any(x.status == "aborted" for x in samples):  # a pause cut it short: continued after the sync
                chunk.samples = samples
                self.paused.append(chunk)
                self.paused_groups += len(chunk.serials)
                continue
            self._finish(samples, now - chunk.started, out)
        self._revive(dead)
        return out

    def _hung(self, timeout: float) -> list[int]:
        """Engines with a call out that do not answer ``health`` within ``timeout`` (or whose probe fails)."""
        import ray

        from tidal.rollout.orchestrate import _failed

        probes = {c.engine: c.actor.health.remote() for c in self.calls.values()}
        answered, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout)
        return [i for i, p in probes.items() if p not in answered or _failed(p)]

    def _revive(self, dead: list[tuple[Chunk, str]]) -> None:
        """Restart the engines of calls that died (or hung) and send each call again, from the driver's copy.

        An engine already replaced (restarted while this call was out) is not restarted again. The resync
        pushes a new weight version only when the trainer trained since the last sync (``trainer_ahead``);
        otherwise the engines get the weights they had, under the same version, and no staleness moves."""
        restart = sorted({c.engine for c, _ in dead if c.actor is self.s.engines.actors[c.engine]})
        if restart:
            self.s.restart_engines(restart, dead[0][1], new_version=self.trainer_ahead)
        for chunk, _ in dead:
            self._submit(chunk)

    def restart_idle_dead(self) -> None:
        """Before a sync: restart engines with no call out that do not answer ``health`` (a sync to a dead
        engine cannot finish). Engines with a call out show their death through that call."""
        import ray

        from tidal.rollout.orchestrate import _failed

        idle = self.idle()
        probes = {i: self.s.engines.actors[i].health.remote() for i in idle}
        if not probes:
            return
        answered, _ = ray.wait(
            list(probes.values()), num_returns=len(probes), timeout=self.s.cfg.rollout.engine_health_timeout
        )
        dead = [i for i, p in probes.items() if p not in answered or _failed(p)]
        if dead:
            self.s.restart_engines(dead, "no health answer before a sync")

    def _finish(self, samples: list[Sample], gen_s: float, out: Finished) -> None:
        samples.sort(key=lambda x: x.index)
        score_samples(samples, self.s.reward_fn)
        kept, metrics = finish_samples(self.s, samples, gen_s)
        by_serial: dict[int, list[Sample]] = {}
        for x in kept:
            by_serial.setdefault(x.group, []).append(x)
        out.groups += [Group(serial, group) for serial, group in sorted(by_serial.items())]
        out.filtered += sorted({x.group for x in samples} - set(by_serial))
        out.metrics.append(metrics)

    def drain(self) -> Finished:
        """Wait for every call in flight (before a sync in one-step mode, or at the end)."""
        out = Finished()
        while self.calls:
            got = self.wait()
            out.groups += got.groups
            out.filtered += got.filtered
            out.metrics += got.metrics
            out.busy_s += got.busy_s
        return out
