"""The engine's output path under load, with a stand-in rank (moeserve.testing.synthetic_ranks)
that steps as fast as it can: every request gets its own tokens and their text, whether its
client is a thread over Engine.stream, `moeserve bench`'s driver or a callback (on_output);
a callback that raises ends its own request only; a rank's death reaches every callback; the
outputs cross the process boundary with every field intact."""

import gc
import pickle
import random
import threading
import time

import pytest

from moeserve.bench import run_bench
from moeserve.runtime.engine import EngineError
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import Finish
from moeserve.testing.synthetic_ranks import SyntheticEngine, expected_tokens

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def printable_prompts(n, rng):
    """ASCII prompts: the stand-in echoes them, so a request's text is its tokens' bytes."""
    return [[rng.randrange(32, 127) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def wait_until(cond, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_threads_over_stream_each_get_their_own_tokens_and_text():
    rng = random.Random(7)
    prompts = printable_prompts(96, rng)
    lens = [rng.randint(1, 40) for _ in prompts]
    got = [None] * len(prompts)
    with SyntheticEngine(skip_tokenizer_init=False, batch=32) as e:
        assert gc.get_freeze_count() > 0  # the startup's objects are out of full collections

        def client(i):
            chunks = list(e.stream(input_ids=prompts[i],
                                   sampling_params={"max_new_tokens": lens[i]}))
            got[i] = chunks

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wait_until(lambda: not e._pending)
        assert e._load == [0]
    for i, chunks in enumerate(got):
        want = expected_tokens(prompts[i], lens[i])
        assert [t for c in chunks for t in c["token_ids"]] == want
        assert "".join(c["text"] for c in chunks) == bytes(want).decode()
        assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == lens[i]
        assert all(c["error"] is None for c in chunks)


@pytest.mark.parametrize("tokenizer", [True, False])
def test_bench_counts_every_token_of_every_request(tokenizer):
    prompts = printable_prompts(300, random.Random(3))
    with SyntheticEngine(skip_tokenizer_init=not tokenizer, batch=64) as e:
        s = run_bench(e, prompts, 17, 128, progress=False)
    assert s["completed"] == 300 and not s["errors"]
    assert s["output_tokens"] == 300 * 17 and s["finish_reasons"] == {"length": 300}
    assert s["ttft_ms_p50"] is not None and s["itl_ms_p50"] is not None


def test_callbacks_get_every_output_in_order_and_one_that_raises_ends_only_its_request(caplog):
    prompts = printable_prompts(40, random.Random(11))
    got = {i: [] for i in range(len(prompts))}
    done = threading.Event()
    finished = []

    def on_output(i):
        def take(out):
            if i == 5 and len(got[i]) == 3:
                raise RuntimeError("a broken client")
            got[i].append(out)
            if out.finish is not None or out.error is not None:
                finished.append(i)
                if len(finished) == len(prompts) - 1:
                    done.set()
        return take

    with SyntheticEngine(batch=8) as e:
        rids = [e.submit(p, {"max_new_tokens": 30}, stream=True, on_output=on_output(i))[0]
                for i, p in enumerate(prompts)]
        assert done.wait(30)
        wait_until(lambda: not e._pending)
        # the engine serves on after the failure
        again = e.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 4})
    assert again["token_ids"] == expected_tokens(prompts[0], 4)
    for i, outs in got.items():
        tokens = [t for o in outs for t in o.token_ids]
        if i == 5:  # its callback raised at its 4th output: nothing more came
            assert tokens == expected_tokens(prompts[i], 3)
            continue
        assert tokens == expected_tokens(prompts[i], 30)
        assert "".join(o.text for o in outs) == bytes(tokens).decode()
        assert outs[-1].finish == Finish("length") and all(o.rid == rids[i] for o in outs)
    assert sorted(finished) == [i for i in range(len(prompts)) if i != 5]
    assert f"request {rids[5]}: its output callback failed" in caplog.text


def test_a_dead_rank_reaches_every_callback_and_later_submits_are_refused():
    outs = []
    lock = threading.Lock()

    def take(out):
        with lock:
            outs.append(out)

    # a step a second: the requests are still running when the rank is killed
    with SyntheticEngine(step_s=1.0) as e:
        for p in printable_prompts(10, random.Random(5)):
            e.submit(p, {"max_new_tokens": 1000}, stream=True, on_output=take)
        e._procs[0].kill()
        wait_until(lambda: sum(o.error is not None for o in outs) == 10)
        with pytest.raises(EngineError, match="rank 0 died"):
            e.submit([1, 2], {"max_new_tokens": 2}, on_output=take)
    assert all("rank 0 died" in o.error for o in outs if o.error is not None)


def test_an_output_pickles_with_every_field():
    out = TokenOutput("rid", [1, 2], Finish("stop", "x"), "text", [{"logprob": -1.0}], 7, 3,
                      "an error", [{"token_id": 4}], True)
    back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == out and type(back) is TokenOutput
    defaults = TokenOutput("rid", [])
    assert all(getattr(out, f) != getattr(defaults, f) for f in out.__dataclass_fields__
               if f != "rid")
