"""The `finetune` command. Thin: each subcommand parses arguments and calls the API.

User errors (FinetuneError) print one paragraph and exit with the error's code (2 for
bad input, 3 when nothing fits); no traceback unless FINETUNE_DEBUG=1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback

from finetune.errors import EXIT_PREEMPTED, EXIT_TRAINING_FAILED, EXIT_USAGE, FinetuneError, is_disk_full


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad arguments already; make the message name the fix."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message}\n  fix: see `{self.prog} --help`\n")


def _add_recipe_args(p: argparse.ArgumentParser, *, hardware=True):
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.lr=2e-4 (repeatable)",
    )
    if hardware:
        p.add_argument(
            "--hardware", default=None, help="preset name, preset YAML file, or auto (default: the recipe's)"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="finetune", description="Plan, compile, run and publish LLM fine-tunes from one YAML recipe.")
    parser.add_argument("--version", action="version", version=f"finetune {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("validate", help="check a recipe (schema, conflicts) and exit")
    _add_recipe_args(p, hardware=False)

    p = sub.add_parser("plan", help="will it fit, how, how fast")
    _add_recipe_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--measure",
        action="store_true",
        help="then run a few real steps at the chosen setting on this machine (nothing saved or "
        "pushed) and print measured vs predicted peak memory and tokens/s; exit 3 when the "
        "measured peak exceeds the usable memory",
    )
    p.add_argument("--steps", type=int, default=5, help="steps to measure with --measure (default 5)")
    p.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="with --measure: run in DIR and keep it, with the profiles of the recipe's logging.profile_steps and "
        "memory_profile_step (default: a temporary directory, removed)",
    )

    p = sub.add_parser("compile", help="write the launch files into a run directory")
    _add_recipe_args(p)
    p.add_argument("-o", "--output", default=None, help="run directory (default: output.dir)")

    p = sub.add_parser("run", help="plan, compile, launch, train, save")
    _add_recipe_args(p)
    p.add_argument("-o", "--output", default=None, help="run directory (default: output.dir)")
    p.add_argument("--dry-run", action="store_true", help="plan and compile only")
    p.add_argument("--resume", default="auto", help="auto (last complete checkpoint), never, or a checkpoint path")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    p.add_argument("--main-address", default=None, help="address of node 0 (multi-node)")
    p.add_argument("--main-port", type=int, default=None, help="rendezvous port (multi-node)")

    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", required=True, help="output directory for the merged model")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest output shard (host RAM while merging is about one shard), e.g. 2GB",
    )

    p = sub.add_parser("push", help="upload an adapter (or merged model) with a model card")
    p.add_argument("run_dir")
    p.add_argument("--repo", required=True, help="ORG/NAME on the Hub")
    p.add_argument("--merged", action="store_true", help="push the merged model, not the adapter")
    p.add_argument("--public", action="store_true", help="make the repo public (default private)")
    p.add_argument("--revision", default=None, help="branch to push to")

    p = sub.add_parser("convert", help="write a recipe from an axolotl, LLaMA-Factory or TRL config")
    p.add_argument("config", help="the peer's YAML config")
    p.add_argument("--from", dest="source", required=True, choices=["axolotl", "llamafactory", "trl"])
    p.add_argument("-o", "--output", required=True, help="the recipe file to write")
    p.add_argument(
        "--method",
        default=None,
        choices=["sft", "dpo", "kto", "reward", "orpo", "cpo"],
        help="trl only: the trl subcommand the config was written for",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="the GPU count the config ran on: its per-GPU micro-batch x accumulation x this is the recipe's "
        "train.global_batch_size (without it, one GPU's, said in a note)",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="the hardware preset (or preset file) the config ran on: its GPU count is --gpus, and the recipe "
        "names it as its hardware",
    )
    _add_after_training_commands(sub)

    p = sub.add_parser("presets", help="list hardware presets")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("models", help="list known model architectures")
    p.add_argument("--json", action="store_true")
    return parser


def _version() -> str:
    from finetune import __version__

    return __version__


def _add_after_training_commands(sub) -> None:
    """After training: try the model (generate), measure it (eval), report the environment (env)."""
    p = sub.add_parser("generate", help="try a trained run: one prompt, a file of prompts, or a chat")
    p.add_argument("run_dir")
    p.add_argument("prompt", nargs="?", help="one prompt (streamed to the console)")
    p.add_argument("--file", help='prompts: .jsonl ({"prompt"} or {"messages"} rows) or text, one per line')
    p.add_argument("--chat", action="store_true", help="interactive chat with the model's chat template")
    p.add_argument("--merged", action="store_true", help="use the merged model (RUN_DIR/merged)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (--file)")
    p.add_argument("--system", default=None, help="a system message before each prompt")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    p.add_argument("-o", "--output", default=None, help="--file: write {prompt, completion} JSON lines here")

    p = sub.add_parser("eval", help="lm-evaluation-harness tasks on the trained model and its base")
    p.add_argument("run_dir")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="a directory with your own task YAML files")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-base", action="store_true", help="skip the base model")
    p.add_argument("--merged", action="store_true", help="use the merged model (RUN_DIR/merged)")
    p.add_argument("--chat-template", action="store_true", help="format prompts with the chat template")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)

    p = sub.add_parser("env", help="versions of the stack, GPUs, CUDA, what --hardware auto sees")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cmd_generate(args):
    from finetune import inference as gen

    settings = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        chat_template=not args.no_chat_template,
        system=args.system,
    )
    chosen = [name for name, on in (("PROMPT", args.prompt), ("--file", args.file), ("--chat", args.chat)) if on]
    if len(chosen) != 1:
        raise FinetuneError(
            f"give exactly one of PROMPT, --file or --chat (got {', '.join(chosen) or 'none'})",
            hint='finetune generate RUN_DIR "Hello", --file prompts.jsonl, or --chat',
        )
    if args.chat:
        return gen.chat(args.run_dir, merged=args.merged, dtype=args.dtype, **settings)
    if args.prompt:
        gen.generate(args.run_dir, args.prompt, merged=args.merged, dtype=args.dtype, stream=True, **settings)
        return 0
    prompts = gen.read_prompts(args.file)
    replies = gen.generate(
        args.run_dir, prompts, merged=args.merged, dtype=args.dtype, batch_size=args.batch_size, **settings
    )
    lines = [json.dumps({"prompt": p, "completion": r}, ensure_ascii=False) for p, r in zip(prompts, replies)]
    if args.output:
        from pathlib import Path

        Path(args.output).write_text("\n".join(lines) + "\n")
        print(f"{len(lines)} completions written to {args.output}")
    else:
        print("\n".join(lines))
    return 0


def _cmd_eval(args):
    from finetune.evaluation import evaluate, render_table

    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    entry = evaluate(
        args.run_dir,
        args.tasks,
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        limit=limit,
        batch_size=args.batch_size,
        base=not args.no_base,
        merged=args.merged,
        apply_chat_template=args.chat_template,
        dtype=args.dtype,
    )
    print(render_table(entry))
    print(
        f"results: {args.run_dir}/summary.json (lm_eval), {args.run_dir}/eval/; the model card shows them "
        "at the next `finetune push`"
    )
    return 0


def _cmd_env(args):
    from finetune.envreport import collect, render

    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _cmd_validate(args):
    from finetune.data.check import check_data
    from finetune.recipe import load_recipe

    recipe = load_recipe(args.recipe, overrides=args.overrides)
    check_data(recipe)  # data paths and every row (no tokenizer, no training)
    print(f"{args.recipe}: valid ({recipe.method.type} / {recipe.adapter.type} / {recipe.model.name})")
    return 0


def _cmd_plan(args):
    from finetune.api import make_plan
    from finetune.errors import EXIT_DOES_NOT_FIT
    from finetune.plan import render_plan_table

    recipe, plan = make_plan(args.recipe, hardware=args.hardware, overrides=args.overrides)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_plan_table(plan))
    if not plan.fits:
        return EXIT_DOES_NOT_FIT
    return _measure(args, recipe) if args.measure else 0


def _measure(args, recipe) -> int:
    """`recipe` is the one just planned: its overrides applied and its example lengths measured."""
    from finetune.api import measure
    from finetune.errors import EXIT_DOES_NOT_FIT
    from finetune.measurement import render_measurement

    print("", flush=True)
    result = measure(recipe, hardware=args.hardware, steps=args.steps, keep=args.keep)
    print(render_measurement(result), flush=True)
    if args.json:
        print(json.dumps(result.to_json()))
    return 0 if result.fits else EXIT_DOES_NOT_FIT


def _cmd_compile(args):
    from finetune.api import compile as compile_recipe

    spec = compile_recipe(args.recipe, hardware=args.hardware, overrides=args.overrides, output=args.output)
    print(spec.summary)
    return 0


class _Print(logging.Handler):
    """Shows the API's progress messages as plain lines on the current stdout."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def _show_api_progress() -> None:
    logger = logging.getLogger("finetune.api")
    if not any(isinstance(h, _Print) for h in logger.handlers):
        logger.addHandler(_Print())
    logger.setLevel(logging.INFO)


def _cmd_run(args):
    from finetune import rundir
    from finetune.api import run

    _show_api_progress()
    result = run(
        args.recipe,
        hardware=args.hardware,
        overrides=args.overrides,
        output=args.output,
        dry_run=args.dry_run,
        resume=args.resume,
        node_rank=args.node_rank,
        main_address=args.main_address,
        main_port=args.main_port,
    )
    if result.instructions is not None:
        print(result.instructions)
    elif args.dry_run:
        print(f"dry run: launch files are in {result.run_dir}; start with `bash {result.run_dir / rundir.LAUNCH_SH}`")
    if result.pushed:
        print(f"pushed to {result.pushed}")
    return result.exit_code


def _cmd_merge(args):
    from finetune.merging import merge

    out = merge(args.run_dir, args.output, max_shard_size=args.max_shard_size)
    print(f"merged model written to {out}")
    return 0


def _cmd_push(args):
    from finetune.hub import push

    url = push(args.run_dir, repo_id=args.repo, merged=args.merged, private=not args.public, revision=args.revision)
    print(f"pushed to {url}")
    return 0


def _cmd_convert(args):
    from pathlib import Path

    from finetune import convert
    from finetune.peers import writes_through

    # the report beside a recipe written to a stream (-o /dev/stdout) goes to stderr, so the stream is the recipe
    report = sys.stderr if writes_through(Path(args.output)) else sys.stdout
    conv = convert(
        args.config,
        source=args.source,
        output=args.output,
        method=args.method,
        gpus=args.gpus,
        hardware=args.hardware,
    )
    material = conv.material
    print(f"wrote {args.output} from the {args.source} config {args.config}", file=report)
    for note in conv.notes:
        print(f"  note: {note}", file=report)
    for d in conv.dropped:
        print(f"  {'NOT MAPPED' if d.material else 'ignored'}: {d.key}: {d.reason}", file=report)
    if conv.error:
        print(f"error: the written recipe does not validate:\n{conv.error}", file=sys.stderr)
    if material:
        print(
            f"error: {len(material)} setting(s) that change training were not mapped (commented in "
            f"{args.output}); settle them by hand",
            file=sys.stderr,
        )
    return EXIT_USAGE if material or conv.error else 0


def _cmd_presets(args):
    from finetune.registry import list_presets

    presets = list_presets()
    if args.json:
        print(json.dumps([p.model_dump() for p in presets], indent=2))
        return 0
    print(f"{'name':26} {'GPUs':>9} {'GiB/GPU':>8} {'link':8} {'fabric':10} {'TFLOP/s':>8}")
    for p in presets:
        gpus = f"{p.nodes}x{p.gpus_per_node}" if p.nodes > 1 else str(p.gpus_per_node)
        print(
            f"{p.name:26} {gpus:>9} {p.gpu_memory_gib:>8.0f} {p.intra_node_link:8} "
            f"{p.inter_node_fabric:10} {p.peak_bf16_tflops:>8.0f}"
        )
    print("\nalso: --hardware auto (detect local GPUs) or --hardware path/to/preset.yaml")
    return 0


def _cmd_models(args):
    from finetune.registry import list_models

    models = list_models()
    if args.json:
        print(json.dumps([m.model_dump() for m in models], indent=2))
        return 0
    print(f"{'key':24} {'family':8} {'layers':>6} {'hidden':>6} {'heads/kv':>9} {'vocab':>7}  hub id")
    for m in models:
        hub = m.hub_ids[0] if m.hub_ids else "-"
        print(
            f"{m.key:24} {m.family:8} {m.num_layers:>6} {m.hidden_size:>6} "
            f"{m.num_attention_heads:>4}/{m.num_kv_heads:<4} {m.vocab_size:>7}  {hub}"
        )
    print("\nany other Hub id or local path works when its config.json is on disk")
    return 0


COMMANDS = {
    "validate": _cmd_validate,
    "plan": _cmd_plan,
    "compile": _cmd_compile,
    "run": _cmd_run,
    "merge": _cmd_merge,
    "push": _cmd_push,
    "convert": _cmd_convert,
    "presets": _cmd_presets,
    "models": _cmd_models,
    "generate": _cmd_generate,
    "eval": _cmd_eval,
    "env": _cmd_env,
}


class Stopped(BaseException):
    """SIGTERM/SIGHUP outside a launch (the launcher forwards them to the ranks while one runs)."""


def _stop(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    api_logger = logging.getLogger("finetune.api")
    level = api_logger.level
    try:
        return _main(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # the API prints nothing once the command is over (main() may run inside a user's process)
        for handler in [h for h in api_logger.handlers if isinstance(h, _Print)]:
            api_logger.removeHandler(handler)
        api_logger.setLevel(level)


def _main(args) -> int:
    try:
        return COMMANDS[args.command](args)
    except Stopped as stop:
        print(f"stopped by {stop} while no training process was running\n  fix: run the command again", file=sys.stderr)
        return EXIT_PREEMPTED
    except FinetuneError as err:
        print(f"error: {err.render()}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(
            "interrupted (Ctrl-C) while no training process was running\n  fix: run the command again", file=sys.stderr
        )
        return 130
    except BrokenPipeError:  # the reader went away (`finetune presets | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        if not is_disk_full(exc):
            return _internal_error(exc)
        print(
            f"error: disk full: {exc.strerror} ({exc.filename or 'a file finetune was writing'})\n"
            "  fix: free disk space there (or lower output.keep), then run the same command again: "
            "a run resumes from its last complete checkpoint",
            file=sys.stderr,
        )
        return EXIT_TRAINING_FAILED if args.command == "run" else 1
    except Exception as exc:
        return _internal_error(exc)


def _internal_error(exc: Exception) -> int:
    """An internal bug: say so, keep the traceback behind a switch."""
    if os.environ.get("FINETUNE_DEBUG"):
        traceback.print_exception(exc)
    else:
        print(
            f"internal error: {type(exc).__name__}: {exc}\n"
            "  this is a bug in finetune; rerun with FINETUNE_DEBUG=1 for the traceback",
            file=sys.stderr,
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
