"""The `moeserve` command: plan, generate, bench, serve and worker."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import sys
from typing import Any, Optional

from moeserve.config import add_config_arguments, config_from_args


def _plan(args: argparse.Namespace) -> int:
    from moeserve.plan.capacity import build_plan
    from moeserve.plan.report import print_plan
    from moeserve.plan.warmup import local_warmup_plan

    plan = build_plan(config_from_args(args))
    warmup = local_warmup_plan(plan)
    if args.json:
        print(json.dumps({**plan.to_json(), "warmup": warmup.to_json()}, indent=2))
    else:
        print_plan(plan)
        if plan.ok:
            print(f"warm-up before ready: {warmup.summary()}"
                  + (f"; not run here: {warmup.skipped}" if warmup.skipped else ""))
    return 0 if plan.ok else 1


# --- sampling flags -------------------------------------------------------------------------

def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=_ids, default=[], help="comma-separated ids")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", action="store_true")
    g.add_argument("--top-logprobs", type=int, default=0)


def sampling_params_from_args(args: argparse.Namespace) -> Any:
    from moeserve.runtime.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty, stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos,
        logprobs=args.logprobs, top_logprobs=args.top_logprobs)


def _engine(args: argparse.Namespace, in_process: Optional[bool] = None) -> Any:
    from moeserve.runtime.engine import Engine

    cfg = config_from_args(args)
    return Engine(in_process=in_process, **dataclasses.asdict(cfg))


def _generate(args: argparse.Namespace) -> int:
    if bool(args.prompt) == bool(args.input_ids):
        print("moeserve generate: give --prompt TEXT or --input-ids 1,2,3 (repeatable), not both",
              file=sys.stderr)
        return 2
    params = sampling_params_from_args(args)
    with _engine(args) as engine:
        if args.prompt:
            results = engine.generate(prompt=list(args.prompt), sampling_params=params)
        else:
            results = engine.generate(input_ids=list(args.input_ids), sampling_params=params)
    failed = [r["error"] for r in results if r["error"]]
    if args.json:
        print(json.dumps({"results": results}))
    else:
        for r in results:
            print(r["text"] if r["error"] is None else f"error: {r['error']}")
    return 1 if failed else 0


def _bench(args: argparse.Namespace) -> int:
    from moeserve.bench import format_summary, random_prompts, run_bench

    # the ranks in processes of their own, as the server runs them: a rank in this process
    # would share its interpreter with the clients' threads, and wait for them at every step
    with _engine(args, in_process=False) as engine:
        if args.prompt:
            prompts = [engine.encode(p) for p in args.prompt]
            prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
        else:
            prompts = random_prompts(args.num_prompts, args.input_len, engine.spec.vocab_size,
                                     args.random_seed)
        summary = run_bench(engine, prompts, args.output_len, args.max_concurrency,
                            progress=not args.no_progress,
                            repetition_penalty=args.repetition_penalty,
                            frequency_penalty=args.frequency_penalty,
                            presence_penalty=args.presence_penalty)
    print(format_summary(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["completed"] == summary["num_prompts"] else 1


def _worker(args: argparse.Namespace) -> int:
    from moeserve.runtime.nodes import run_follower_node

    return run_follower_node(config_from_args(args))


def _serve(args: argparse.Namespace) -> int:
    from moeserve.server.app import serve

    return serve(config_from_args(args), host=args.host, port=args.port,
                 max_queue=args.max_queued_requests,
                 # a hub id stays the model's name (the config holds its snapshot's folder)
                 served_model_name=args.served_model_name or args.model,
                 drain_timeout=args.drain_timeout, log_level=args.log_level,
                 api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                 request_read_timeout=args.request_read_timeout,
                 tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                 chat_template=args.chat_template,
                 allowed_origins=[o.strip() for arg in args.allowed_origins
                                  for o in arg.split(",") if o.strip()])


def build_parser() -> argparse.ArgumentParser:
    from moeserve.server.reasoning import REASONING_PARSERS
    from moeserve.server.tool_parsers import TOOL_PARSERS

    parser = argparse.ArgumentParser(prog="moeserve", description="Serve mixture-of-experts "
                                     "language models, with every buffer planned up front.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="print the capacity plan for a config, and its errors")
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=_plan)

    g = sub.add_parser("generate", help="generate text for prompts and print it")
    add_config_arguments(g)
    add_sampling_arguments(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--input-ids", action="append", type=_ids, default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    g.add_argument("--json", action="store_true", help="print {\"results\": [...]} as JSON")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="offline throughput, TTFT and ITL")
    add_config_arguments(b)
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--max-concurrency", type=int, default=16)
    b.add_argument("--prompt", action="append", default=[],
                   help="use these prompts (cycled) instead of random token ids")
    b.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="for every request (the bench samples greedily)")
    b.add_argument("--frequency-penalty", type=float, default=0.0)
    b.add_argument("--presence-penalty", type=float, default=0.0)
    b.add_argument("--json", metavar="FILE", help="also write the summary as JSON to FILE")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench)

    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_config_arguments(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model)")
    s.add_argument("--max-queued-requests", type=int, default=1024,
                   help="sequences (prompts x n) in flight beyond which the server answers 503 "
                   "with Retry-After")
    s.add_argument("--drain-timeout", type=float, default=600.0,
                   help="on SIGTERM or SIGINT, seconds to let requests in flight finish "
                   "(/health and new requests answer 503 meanwhile); those left then end with "
                   "an error (a stream: an error event, then [DONE]). A second signal stops at "
                   "once")
    s.add_argument("--api-key", default=None,
                   help="ask for 'Authorization: Bearer KEY' on every route but /health "
                   "(without it, no key is asked)")
    s.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024,
                   help="larger request bodies are refused with 413")
    s.add_argument("--request-read-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's headers must arrive within this many seconds of the "
                   "connection opening (or of the previous response), else the connection is "
                   "closed; its body within as many seconds of the headers, else 408")
    s.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins (or comma lists of them, '*' for any) whose web pages may call "
                   "the server (CORS); without it, no CORS headers are sent")
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the tool-call format of the model (hermes: Qwen2.5/Qwen3 <tool_call>; "
                   "mistral; deepseek-v3): reads calls into tool_calls and forces them for "
                   "tool_choice required or a named function")
    s.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into reasoning_content")
    s.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a jinja2 chat template file that replaces the checkpoint's")
    s.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(func=_serve)

    w = sub.add_parser("worker", help="run this node's ranks of a multi-node engine "
                       "(--nnodes N --node-rank K >= 1 --dist-init-addr HOST:PORT)")
    add_config_arguments(w)
    w.set_defaults(func=_worker)
    return parser


def _user_error(exc: BaseException, args: argparse.Namespace) -> Optional[str]:
    """The one-line message for a mistake the user can fix (the exception's message says
    what to change), or None for an error of ours, whose traceback is kept."""
    from moeserve.models.loader import WeightLoadError
    from moeserve.runtime.engine import EngineError

    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        where = f"--host {getattr(args, 'host', '?')} --port {getattr(args, 'port', '?')}"
        return (f"cannot listen on {where}: {exc.strerror}; give another --port (0 picks a "
                f"free one) or --host")
    if isinstance(exc, (ValueError, EngineError, WeightLoadError, FileNotFoundError,
                        PermissionError, IsADirectoryError, NotADirectoryError)):
        return str(exc)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("moeserve: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = _user_error(exc, args)
        if message is None:
            raise
        print(f"moeserve: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
