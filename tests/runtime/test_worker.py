"""The rank loop's iteration on one CPU rank, with and without the overlap schedule."""

import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.parallel.groups import single_process_state
from moeserve.parallel.devices import runtime_config
from moeserve.runtime.engine import make_plan
from moeserve.runtime.request import RequestInput
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.worker import Message, RankWorker
from sampling_cases import varied


def _worker(overlap: bool, **flags) -> RankWorker:
    torch.manual_seed(0)  # the same dummy weights for every worker
    cfg = runtime_config(EngineConfig(model="preset:tiny", load_format="dummy", device="cpu",
                                      context_length=128, max_running_requests=4,
                                      disable_overlap_schedule=not overlap, random_seed=1,
                                      **flags))
    plan = make_plan(cfg)
    return RankWorker(cfg, plan.spec, plan, single_process_state(plan.layout), (3,))


def _count_launches(worker: RankWorker) -> list[int]:
    launches = []
    launch = worker.runner.launch_forward  # (the worker launches a step in two halves)

    def counted(batch, *a, **k):
        launches.append(0 if batch is None else len(batch.reqs))
        return launch(batch, *a, **k)

    worker.runner.launch_forward = counted
    return launches


@pytest.mark.parametrize("overlap", [False, True])
def test_the_loop_stays_busy_until_the_last_token_is_out(overlap):
    """After the prefill of the only request, the loop must not idle (it would wait a tick
    for messages before the request's first decode), nor before the tokens of the step in
    flight are out; a request that the token in flight ends by length runs no more rows."""
    worker = _worker(overlap)
    launches = _count_launches(worker)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    add = Message("add", RequestInput("r0", tuple(range(1, 17)), params, 0, True))
    tokens, finish, busy_iterations = [], [], 0
    msgs = [add]
    while True:
        outs, _, busy = worker.iteration(msgs)
        msgs = []
        tokens += [t for o in outs for t in o.token_ids]
        finish += [(busy_iterations, o.finish.reason) for o in outs if o.finish]
        if not busy:
            break
        busy_iterations += 1
    assert not outs and worker.in_flight is None
    assert len(tokens) == 3 and launches == [1, 1, 1]  # prefill, two decodes
    # without overlap the third step's tokens come with it; with overlap one iteration later
    assert busy_iterations == (4 if overlap else 3)
    assert finish == [(busy_iterations - 1, "length")]


def _serve(worker: RankWorker, arrivals: dict[int, list[RequestInput]],
           aborts: dict[int, str]) -> dict[str, tuple]:
    """Iterate until every request is done: rid -> (tokens, logprobs, finish)."""
    got: dict[str, list] = {}
    finished: dict[str, tuple] = {}
    step, busy = 0, True
    while busy or arrivals:
        msgs = [Message("add", r) for r in arrivals.pop(step, [])]
        if step in aborts:
            msgs.append(Message("abort", aborts[step]))
        outs, _, busy = worker.iteration(msgs)
        step += 1
        assert step < 500
        for o in outs:
            toks, lps = got.setdefault(o.rid, [[], []])
            toks += o.token_ids
            lps += [(lp["token_id"], round(lp["logprob"], 4)) for lp in o.logprobs]
            if o.finish is not None:
                finished[o.rid] = (toks, lps, o.finish.reason, o.error)
    # every KV slot is back: free, or held by the prefix cache and nothing else
    kv = worker.scheduler.kv
    assert kv.used_slots == (kv.radix.cached_tokens if kv.radix else 0)
    assert kv.radix is None or kv.radix.protected_tokens == 0
    assert worker.in_flight is None and not worker.scheduler.has_work
    return finished


def test_overlap_gives_the_tokens_of_the_plain_loop():
    """Greedy, seeded sampling, penalties, logprobs, stop tokens, lengths, an abort, and
    requests arriving while others decode: the same outputs with the overlap schedule."""
    def requests(stop: list[int]):
        p = dict(temperature=0.0, ignore_eos=True)
        cases = {
            "greedy": SamplingParams(max_new_tokens=9, **p),
            "one": SamplingParams(max_new_tokens=1, **p),
            **varied(stop),
            "aborted": SamplingParams(max_new_tokens=30, **p),
        }
        arrivals: dict[int, list[RequestInput]] = {}
        for i, (rid, params) in enumerate(cases.items()):
            prompt = tuple((7 * i + 3 * j) % 200 + 1 for j in range(5 + 3 * i))
            arrivals.setdefault(2 * i, []).append(RequestInput(rid, prompt, params, 0, True))
        return arrivals

    plain = _serve(_worker(False), requests([]), {20: "aborted"})
    stop = [plain["stop"][0][4]]  # ends "stop" at its fifth token (or before)
    plain = _serve(_worker(False), requests(stop), {20: "aborted"})
    worker = _worker(True)
    launches = _count_launches(worker)
    overlapped = _serve(worker, requests(stop), {20: "aborted"})
    assert plain["stop"][2] == "stop" and len(plain["stop"][0]) <= 5
    assert overlapped.pop("aborted")[2] == plain.pop("aborted")[2] == "abort"
    assert overlapped == plain
    assert any(n > 1 for n in launches)  # requests did run side by side


def test_penalised_requests_keep_the_overlap():
    """Penalties count the token in flight on the device: the loop does not wait for it,
    and the tokens are those of the plain loop."""
    params = SamplingParams(max_new_tokens=10, frequency_penalty=1.2, presence_penalty=0.4,
                            repetition_penalty=1.3, temperature=0.0, ignore_eos=True)

    def requests():
        return {0: [RequestInput(f"r{i}", tuple((5 * i + 2 * j) % 90 + 1 for j in range(6 + i)),
                                 params, 0, True) for i in range(3)]}

    plain = _serve(_worker(False), requests(), {})
    worker = _worker(True)
    waits = []
    needs = worker.scheduler.needs_tokens
    worker.scheduler.needs_tokens = lambda: waits.append(needs()) or waits[-1]
    assert _serve(worker, requests(), {}) == plain
    assert waits and not any(waits)


def test_tokens_in_flight_go_out_before_a_prefill_is_launched():
    """With the overlap schedule, a prefill's long launch must not hold back the tokens of
    the decode step before it: they are published first."""
    worker = _worker(True)
    events = []
    launch = worker.runner.launch_forward

    def logged(batch, *a, **k):
        events.append(("launch", None if batch is None else batch.mode.name))
        return launch(batch, *a, **k)

    worker.runner.launch_forward = logged
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    first = Message("add", RequestInput("a", tuple(range(1, 9)), params, 0, True))
    second = Message("add", RequestInput("b", tuple(range(3, 14)), params, 0, True))
    publish = lambda outs: events.append(("publish", [o.rid for o in outs]))  # noqa: E731
    for msgs in ([first], [], [], [second], []):
        outs, _, _ = worker.iteration(msgs, publish)
        events.append(("return", [o.rid for o in outs]))
    i = events.index(("launch", "EXTEND"), events.index(("launch", "EXTEND")) + 1)  # b's
    assert events[i - 1] == ("publish", ["a"])  # a's token of the decode in flight
    assert events[i + 1] == ("return", [])


def test_the_host_waits_for_an_event_recorded_after_the_token_copies(monkeypatch):
    """model_runner.copy_to_host queues every copy before it records the event that `collect`
    waits for (recorded first, the host read the pinned tensors before the copies landed: a
    step's tokens came back stale at random steps on the H200). The GPU's stream is stood in
    for by a log of what was queued, in order."""
    import torch

    from moeserve.runtime import model_runner

    queued = []

    class Event:
        def record(self):
            queued.append("event")

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        queued.append("copy")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "to", to)
    tokens, logprobs = torch.tensor([5, 7]), torch.tensor([-0.5, -1.0])
    copies, done = model_runner.copy_to_host([tokens, logprobs, None, None],
                                             torch.device("cuda"))
    assert queued == ["copy", "copy", "event"] and isinstance(done, Event)
    assert copies[0].tolist() == [5, 7] and copies[2] is None and copies[3] is None
    queued.clear()
    copies, done = model_runner.copy_to_host([tokens, None, None, None], torch.device("cpu"))
    assert queued == ["copy"] and done is None  # on a CPU the copy is done when it returns
