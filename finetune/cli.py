"""The `finetune` command. Thin: each subcommand parses arguments and calls the API.

User errors (FinetuneError) print one paragraph and exit with the error's code (2 for
bad input, 3 when nothing fits); no traceback unless FINETUNE_DEBUG=1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback

from finetune.errors import EXIT_PREEMPTED, EXIT_USAGE, FinetuneError


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad arguments already; make the message name the fix."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message}\n  fix: see `{self.prog} --help`\n")


def _add_recipe_args(p: argparse.ArgumentParser, *, hardware=True):
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.lr=2e-4 (repeatable)")
    if hardware:
        p.add_argument("--hardware", default=None,
                       help="preset name, preset YAML file, or auto (default: the recipe's)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="finetune", description="Plan, compile, run and publish LLM fine-tunes "
                                                   "from one YAML recipe.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("validate", help="check a recipe (schema, conflicts) and exit")
    _add_recipe_args(p, hardware=False)

    p = sub.add_parser("plan", help="will it fit, how, how fast")
    _add_recipe_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("compile", help="write the launch files into a run directory")
    _add_recipe_args(p)
    p.add_argument("-o", "--output", default=None, help="run directory (default: output.dir)")

    p = sub.add_parser("run", help="plan, compile, launch, train, save")
    _add_recipe_args(p)
    p.add_argument("-o", "--output", default=None, help="run directory (default: output.dir)")
    p.add_argument("--dry-run", action="store_true", help="plan and compile only")
    p.add_argument("--resume", default="auto",
                   help="auto (last complete checkpoint), never, or a checkpoint path")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (multi-node)")
    p.add_argument("--main-address", default=None, help="address of node 0 (multi-node)")
    p.add_argument("--main-port", type=int, default=None, help="rendezvous port (multi-node)")

    p = sub.add_parser("merge", help="merge a LoRA adapter into its base model")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", required=True, help="output directory for the merged model")

    p = sub.add_parser("push", help="upload an adapter (or merged model) with a model card")
    p.add_argument("run_dir")
    p.add_argument("--repo", required=True, help="ORG/NAME on the Hub")
    p.add_argument("--merged", action="store_true", help="push the merged model, not the adapter")
    p.add_argument("--public", action="store_true", help="make the repo public (default private)")
    p.add_argument("--revision", default=None, help="branch to push to")

    p = sub.add_parser("presets", help="list hardware presets")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("models", help="list known model architectures")
    p.add_argument("--json", action="store_true")
    return parser


def _cmd_validate(args):
    from finetune.recipe import load_recipe

    from finetune.train.precheck import check_data

    recipe = load_recipe(args.recipe, overrides=args.overrides)
    check_data(recipe)  # data paths and every row (no tokenizer, no training)
    print(f"{args.recipe}: valid ({recipe.method.type} / {recipe.adapter.type} / {recipe.model.name})")
    return 0


def _cmd_plan(args):
    from finetune.api import make_plan
    from finetune.errors import EXIT_DOES_NOT_FIT
    from finetune.plan import render_plan_table

    _, plan = make_plan(args.recipe, hardware=args.hardware, overrides=args.overrides)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_plan_table(plan))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def _cmd_compile(args):
    from finetune.api import compile as compile_recipe

    spec = compile_recipe(args.recipe, hardware=args.hardware, overrides=args.overrides,
                          output=args.output)
    print(spec.summary)
    return 0


def _cmd_run(args):
    from finetune.api import run

    result = run(args.recipe, hardware=args.hardware, overrides=args.overrides, output=args.output,
                 dry_run=args.dry_run, resume=args.resume, node_rank=args.node_rank,
                 main_address=args.main_address, main_port=args.main_port)
    return result.exit_code


def _cmd_merge(args):
    from finetune.merge import merge

    out = merge(args.run_dir, args.output)
    print(f"merged model written to {out}")
    return 0


def _cmd_push(args):
    from finetune.hub import push

    url = push(args.run_dir, repo_id=args.repo, merged=args.merged, private=not args.public,
               revision=args.revision)
    print(f"pushed to {url}")
    return 0


def _cmd_presets(args):
    from finetune.registry import list_presets

    presets = list_presets()
    if args.json:
        print(json.dumps([p.model_dump() for p in presets], indent=2))
        return 0
    print(f"{'name':26} {'GPUs':>9} {'GiB/GPU':>8} {'link':8} {'fabric':10} {'TFLOP/s':>8}")
    for p in presets:
        gpus = f"{p.nodes}x{p.gpus_per_node}" if p.nodes > 1 else str(p.gpus_per_node)
        print(f"{p.name:26} {gpus:>9} {p.gpu_memory_gib:>8.0f} {p.intra_node_link:8} "
              f"{p.inter_node_fabric:10} {p.peak_bf16_tflops:>8.0f}")
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
        print(f"{m.key:24} {m.family:8} {m.num_layers:>6} {m.hidden_size:>6} "
              f"{m.num_attention_heads:>4}/{m.num_kv_heads:<4} {m.vocab_size:>7}  {hub}")
    print("\nany other Hub id or local path works when its config.json is on disk")
    return 0


COMMANDS = {
    "validate": _cmd_validate, "plan": _cmd_plan, "compile": _cmd_compile, "run": _cmd_run,
    "merge": _cmd_merge, "push": _cmd_push, "presets": _cmd_presets, "models": _cmd_models,
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
    try:
        return _main(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(args) -> int:
    try:
        return COMMANDS[args.command](args)
    except Stopped as stop:
        print(f"stopped by {stop} while no training process was running\n"
              "  fix: run the command again", file=sys.stderr)
        return EXIT_PREEMPTED
    except FinetuneError as err:
        print(f"error: {err.render()}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C) while no training process was running\n"
              "  fix: run the command again", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`finetune presets | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # an internal bug: say so, keep the traceback behind a switch
        if os.environ.get("FINETUNE_DEBUG"):
            traceback.print_exc()
        else:
            print(f"internal error: {type(exc).__name__}: {exc}\n"
                  "  this is a bug in finetune; rerun with FINETUNE_DEBUG=1 for the traceback",
                  file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
