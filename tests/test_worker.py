"""The rank loop's iteration on one CPU rank."""

from moeserve.config import EngineConfig
from moeserve.parallel.groups import single_process_state
from moeserve.runtime.devices import runtime_config
from moeserve.runtime.engine import make_plan
from moeserve.runtime.request import RequestInput
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.worker import Message, RankWorker


def _worker() -> RankWorker:
    cfg = runtime_config(EngineConfig(model="preset:tiny", load_format="dummy", device="cpu",
                                      context_length=128, max_running_requests=4))
    plan = make_plan(cfg)
    return RankWorker(cfg, plan.spec, plan, single_process_state(plan.layout), ())


def test_a_prefill_in_flight_counts_as_work():
    """After the prefill of the only request, the loop must not idle (it would wait a tick
    for new messages before the request's first decode)."""
    worker = _worker()
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    add = Message("add", RequestInput("r0", tuple(range(1, 17)), params, 0, True))
    has_work = []
    outs, _, busy = worker.iteration([add])
    while busy:
        has_work.append(busy)
        outs, _, busy = worker.iteration([])
    # prefill (token 1), decode (token 2), decode (token 3, finished), then nothing
    assert len(has_work) == 3
    outs, _, busy = worker.iteration([])
    assert not busy and not outs
