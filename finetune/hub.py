"""`finetune push`: publish a run (adapter, or merged/full model) to the Hugging Face Hub.

What is uploaded is an explicit list, never a glob over RUN_DIR: the weights (adapter, or the
merged/full model), tokenizer files, a generated README.md model card, recipe.resolved.yaml and
loss.png. Checkpoints, optimizer state, caches, logs and metrics stay local.

How the upload works, and why it resumes: one `HfApi.create_commit` with an explicit operation
list (README.md is passed as bytes, so nothing is written into RUN_DIR). Inside it, huggingface_hub
asks the Hub's preupload endpoint which files are already in the repo (unchanged ones are dropped
from the commit), then uploads large files through Xet when `hf_xet` is installed (content-defined
chunks; chunks the Hub already has are not sent again) or through git-LFS (the LFS batch endpoint
returns no upload action for blobs already in storage, so they are skipped). A push that fails in
the middle therefore resumes on retry: blobs stored by the failed attempt are not re-sent, and
nothing is visible in the repo until the single commit succeeds.
`upload_large_folder` is not used: it keeps its resume state in `<folder>/.cache/huggingface/`, i.e.
inside RUN_DIR, which a push must leave untouched; `upload_folder` would need the model card
written into RUN_DIR as well.

The token comes from `token=`, HF_TOKEN or the saved login (huggingface_hub.get_token()). It is
only handed to HfApi; it is never logged, printed, or written anywhere, and is scrubbed from
error messages as a last line of defence.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from finetune import rundir
from finetune.errors import FinetuneError
from finetune.merging import ADAPTER_FILES, TOKENIZER_FILES, merge, refuse_random_init, run_kind
from finetune.modelcard import HUB_ID, parse_front_matter, public_recipe, render_model_card

logger = logging.getLogger(__name__)

EXIT_PUSH_FAILED = 5
# A full model saved by save_pretrained; "model*.safetensors" covers the shards and the single file.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
EXTRA_FILES = (rundir.RESOLVED_RECIPE, rundir.LOSS_PNG)


class PushError(FinetuneError):
    """The push failed; the message says what failed and the exact command to retry."""

    exit_code = EXIT_PUSH_FAILED


def retry_command(run_dir: Path, *, repo_id: str, merged: bool, private: bool, revision: str | None) -> str:
    parts = ["finetune", "push", str(run_dir), "--repo", repo_id]
    if merged:
        parts.append("--merged")
    if not private:
        parts.append("--public")
    if revision:
        parts += ["--revision", revision]
    return " ".join(parts)


def _scrub(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def registry_license(recipe) -> str | None:
    """The base model's license from the model registry, when the model is listed there."""
    from finetune.registry import list_models

    for arch in list_models():
        if arch.key == recipe.model.arch or recipe.model.name in arch.hub_ids:
            return arch.license
    return None


def base_license(recipe, base: str) -> str | None:
    """License of the base: the registry first, else a local base model's own card metadata."""
    found = registry_license(recipe)
    if found:
        return found
    readme = Path(base) / "README.md"
    if readme.is_file():
        value = parse_front_matter(readme.read_text(errors="replace")).get("license")
        return value if isinstance(value, str) else None
    return None


def _model_files(model_dir: Path) -> list[Path]:
    files = [model_dir / f for f in MODEL_FILES if (model_dir / f).is_file()]
    files += sorted(model_dir.glob("model*.safetensors"))
    return files


def _collect(run_dir: Path, weights_dir: Path, kind: str) -> list[tuple[str, Path]]:
    """(path in repo, local file) for everything but README.md."""
    if kind == "adapter":
        weights = [run_dir / f for f in ADAPTER_FILES]
    else:
        weights = _model_files(weights_dir)
    tokenizer_dir = weights_dir if any((weights_dir / f).is_file() for f in TOKENIZER_FILES) else run_dir
    tokenizer = [tokenizer_dir / f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
    extras = [run_dir / f for f in EXTRA_FILES if (run_dir / f).is_file()]
    return [(p.name, p) for p in weights + tokenizer + extras]


PLACEHOLDER_NAMESPACES = ("my-org", "your-org", "org", "user", "username", "your-username")


def _can_write(whoami: dict, namespace: str) -> tuple[bool, str]:
    """(allowed, why not) for creating/committing to a repo under `namespace` with this token."""
    user = whoami.get("name")
    orgs = {o.get("name"): o.get("roleInOrg") for o in whoami.get("orgs") or []}
    if namespace != user and namespace not in orgs:
        member = ", ".join([user or "?", *orgs]) if user else ", ".join(orgs)
        return False, f"the token's user {user!r} is not {namespace!r} nor a member of it (can write to: {member})"
    if orgs.get(namespace) == "read":
        return False, f"{user!r} has the read role in the organization {namespace!r}"
    token = (whoami.get("auth") or {}).get("accessToken") or {}
    role = token.get("role")
    if role == "read":
        return False, "the token is a read token"
    if role == "fineGrained":
        grants = (token.get("fineGrained") or {}).get("scoped") or []
        for grant in grants:
            if (grant.get("entity") or {}).get("name") == namespace and "repo.write" in grant.get("permissions", []):
                return True, ""
        return False, f"the fine-grained token has no repo.write permission on {namespace!r}"
    return True, ""


def check_push_access(
    repo_id: str, *, private: bool = True, token: str | None = None, endpoint: str | None = None, key: str = "hub.repo"
) -> str:
    """Before training: the Hub is reachable, we are logged in, and the token may write to `repo_id`'s
    namespace (huggingface_hub's whoami), and an existing repo does not contradict `private`.
    Returns the user name. RecipeError (exit 2) with the fix otherwise; the token is never shown."""
    from finetune.errors import RecipeError

    namespace = repo_id.split("/")[0]
    if namespace.lower() in PLACEHOLDER_NAMESPACES:
        raise RecipeError(
            f"{repo_id!r} is a placeholder, not your Hub repo",
            key=key,
            hint="set hub.repo to YOUR-USER-OR-ORG/NAME (e.g. --set hub.repo=alice/llama-lora), "
            "or remove hub.repo to keep the run local",
        )
    import huggingface_hub
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    if huggingface_hub.constants.is_offline_mode():
        raise RecipeError(
            "this run pushes to the Hub at the end, but the Hub is in offline mode (HF_HUB_OFFLINE is set)",
            key=key,
            hint="unset HF_HUB_OFFLINE, or remove hub.repo and push later with `finetune push`",
        )
    token = token or huggingface_hub.get_token()
    if not token:
        raise RecipeError(
            "this run pushes to the Hub at the end, but you are not logged in",
            key=key,
            hint="set HF_TOKEN or run `hf auth login`, or remove hub.repo",
        )
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        who = api.whoami()
    except Exception as exc:  # invalid token (401), no network
        raise RecipeError(
            _scrub(f"cannot check Hub access: {type(exc).__name__}: {exc}", token),
            key=key,
            hint="check HF_TOKEN / `hf auth login` and the network, or remove hub.repo",
        ) from None
    allowed, why = _can_write(who, namespace)
    if not allowed:
        raise RecipeError(
            f"cannot push to {repo_id}: {why}",
            key=key,
            hint="use a write token for that namespace (hf auth login), or set hub.repo to a "
            "namespace you can write to",
        )
    try:
        info = api.model_info(repo_id)
    except RepositoryNotFoundError:
        return who.get("name", "")
    except Exception as exc:
        raise RecipeError(
            _scrub(f"cannot read {repo_id} on the Hub: {type(exc).__name__}: {exc}", token),
            key=key,
            hint="check the network and the repo id",
        ) from None
    if private and info.private is False:
        raise RecipeError(
            f"{repo_id} exists and is public, and hub.private is true",
            key="hub.private",
            hint="set hub.private: false to push to the public repo, or use another hub.repo",
        )
    return who.get("name", "")


def _upload_content(name: str, path: Path, recipe) -> str | bytes:
    """The file to upload; recipe.resolved.yaml goes with local paths reduced to their names."""
    if name == rundir.RESOLVED_RECIPE:
        import yaml

        return yaml.safe_dump(public_recipe(recipe), sort_keys=False).encode("utf-8")
    return str(path)


def push(
    run_dir: str | Path,
    *,
    repo_id: str,
    merged: bool = False,
    private: bool = True,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    max_shard_size: str | int = "5GB",
) -> str:
    """Upload RUN_DIR to the Hub repo `repo_id` (created private unless private=False).

    merged=True uploads a merged model instead of the adapter: RUN_DIR/merged if it holds one,
    else the adapter is merged into a temporary directory next to RUN_DIR (removed afterwards).
    A full fine-tune run uploads its model either way. `revision` pushes to that branch (created
    from main if missing). `endpoint` defaults to HF_ENDPOINT, read at call time.
    Returns the commit URL. Raises PushError (exit code 5) with the retry command on failure;
    RUN_DIR is never modified.
    """
    run_dir = Path(run_dir)
    retry = retry_command(run_dir, repo_id=repo_id, merged=merged, private=private, revision=revision)
    recipe, kind = _check_run(run_dir, repo_id=repo_id)
    token = _hub_token(token, retry=retry)
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    card_kind = "full" if kind == "full" else ("merged" if merged else "adapter")
    target = _Target(repo_id=repo_id, private=private, revision=revision, token=token, retry=retry)
    with _weights_dir(run_dir, card_kind=card_kind, max_shard_size=max_shard_size) as weights_dir:
        base = _base_model(run_dir, recipe, kind=kind)
        operations = _operations(
            run_dir, recipe, weights_dir=weights_dir, card_kind=card_kind, base=base, target=target
        )
        message = commit_message or (
            f"finetune: {recipe.method.type} "
            f"{'merged model' if card_kind == 'merged' else card_kind}"
            f" of {Path(base).name if not HUB_ID.match(base) else base}"
        )
        url = _commit(target, operations=operations, message=message, endpoint=endpoint)
    logger.info("pushed to %s", url)
    return url


@dataclass(frozen=True)
class _Target:
    """Where a push goes, and what to tell the user when it fails."""

    repo_id: str
    private: bool
    revision: str | None
    token: str
    retry: str  # the command that retries this push

    def fail(self, what: str, exc: BaseException | None = None, hint: str | None = None) -> PushError:
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        message = _scrub(f"push to {self.repo_id} failed while {what}{detail}", self.token)
        return PushError(
            message,
            hint=hint or f"fix the cause, then retry with `{self.retry}` (files already uploaded are not sent again)",
        )


def _check_run(run_dir: Path, *, repo_id: str):
    """(resolved recipe, run kind) of a run directory that holds final weights; PushError otherwise."""
    if not HUB_ID.match(repo_id):
        raise PushError(
            f"--repo {repo_id!r} is not a Hub repo id",
            key="hub.repo",
            hint="use ORG/NAME, e.g. --repo my-org/llama-3.1-8b-sft",
        )
    if not (run_dir / rundir.RESOLVED_RECIPE).is_file():
        raise PushError(
            f"not a run directory (no {rundir.RESOLVED_RECIPE})",
            file=str(run_dir),
            hint="pass the directory `finetune run` wrote its outputs to",
        )
    from finetune.recipe import load_recipe

    recipe = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True)
    refuse_random_init(run_dir, recipe, why="not a model to publish", error=PushError)
    kind = run_kind(run_dir)
    if kind == "unknown":
        raise PushError(
            "no adapter (adapter_config.json) or model (config.json + *.safetensors) found",
            file=str(run_dir),
            hint="the run has not saved its final weights; resume it with `finetune run`",
        )
    return recipe, kind


def _hub_token(token: str | None, *, retry: str) -> str:
    """The token to push with (argument, HF_TOKEN or the saved login); PushError when offline or
    logged out."""
    from huggingface_hub import constants, get_token

    if constants.is_offline_mode():
        raise PushError(
            "the Hugging Face Hub is in offline mode (HF_HUB_OFFLINE is set)",
            hint=f"unset HF_HUB_OFFLINE, then run `{retry}`",
        )
    token = token or get_token()
    if not token:
        raise PushError(
            "not logged in to the Hugging Face Hub", hint=f"set HF_TOKEN or run `hf auth login`, then run `{retry}`"
        )
    return token


@contextmanager
def _weights_dir(run_dir: Path, *, card_kind: str, max_shard_size: str | int):
    """The directory whose weights are uploaded: RUN_DIR, RUN_DIR/merged, or the adapter merged into a
    temporary directory next to RUN_DIR (never inside it), removed afterwards."""
    if card_kind != "merged":
        yield run_dir
        return
    if run_kind(run_dir / "merged") == "full":
        yield run_dir / "merged"
        return
    try:  # next to RUN_DIR: the same disk the run had room on
        work_dir = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.push-", dir=run_dir.parent))
    except OSError:  # read-only parent: fall back to the system temp dir
        work_dir = Path(tempfile.mkdtemp(prefix=f"{run_dir.name}.push-"))
    try:
        logger.info("merging the adapter for upload into %s", work_dir)
        yield merge(run_dir, work_dir / "merged", max_shard_size=max_shard_size)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _base_model(run_dir: Path, recipe, *, kind: str) -> str:
    """The base model as the adapter names it (its adapter_config.json), else the recipe's."""
    if kind != "adapter":
        return recipe.model.name
    adapter_config = json.loads((run_dir / "adapter_config.json").read_text())
    return adapter_config.get("base_model_name_or_path") or recipe.model.name


def _operations(run_dir: Path, recipe, *, weights_dir: Path, card_kind: str, base: str, target: _Target) -> list:
    """The commit: the collected files plus the generated model card (passed as bytes)."""
    from huggingface_hub import CommitOperationAdd

    card = render_model_card(
        recipe,
        run_dir=run_dir,
        repo_id=target.repo_id,
        kind=card_kind,
        license=base_license(recipe, base),
        base_model=recipe.model.name,
    )
    files = _collect(run_dir, weights_dir, card_kind)
    total = sum(p.stat().st_size for _, p in files)
    logger.info(
        "pushing %d files (%.1f MB) + README.md to %s (%s%s)",
        len(files),
        total / 1e6,
        target.repo_id,
        "private" if target.private else "public",
        f", branch {target.revision}" if target.revision else "",
    )
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=_upload_content(name, path, recipe))
        for name, path in files
    ]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    return operations


def _commit(target: _Target, *, operations: list, message: str, endpoint: str | None) -> str:
    """Create the repo (refusing a private push into an existing public repo) and the branch, then
    commit every operation at once; returns the commit URL."""
    from huggingface_hub import HfApi

    repo_id, revision = target.repo_id, target.revision
    api = HfApi(endpoint=endpoint, token=target.token)
    step = "creating the repository"
    try:
        api.create_repo(repo_id, private=target.private, exist_ok=True)
        step = "checking the repository's visibility"
        info = api.model_info(repo_id)
        if target.private and info.private is False:
            raise target.fail(
                "checking the repository's visibility",
                hint=(
                    f"{repo_id} already exists and is public, and a private push was asked for; "
                    f"push to another repo, or add --public: `{target.retry} --public`"
                ),
            )
        if revision and revision != "main":
            step = f"creating the branch {revision!r}"
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        step = "uploading and committing the files"
        commit = api.create_commit(repo_id, operations=operations, commit_message=message, revision=revision)
    except PushError:
        raise
    except Exception as exc:  # HTTP errors, connection errors, bad server answers
        raise target.fail(step, exc) from None
    return commit.commit_url


def push_from_recipe(run_dir: str | Path, **kwargs) -> str | None:
    """Push as the run's recipe `hub:` section says; None when hub.repo is unset.

    Called at the end of a successful run; only rank 0 pushes (other ranks return None).
    """
    import sys

    run_dir = Path(run_dir)
    if "torch" in sys.modules:  # a launched rank; single-process callers never import torch first
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return None
    from finetune.recipe import load_recipe

    hub = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True).hub
    if not hub.repo:
        return None
    target = _recipe_push(hub)
    url = push(run_dir, repo_id=hub.repo, merged=target["merged"], private=hub.private, revision=hub.revision, **kwargs)
    # written last: a push stopped before it (a signal, a lost connection) is made again by a rerun
    rundir.write_json_atomic(run_dir / rundir.PUSHED, {**target, "url": url})
    return url


def _recipe_push(hub) -> dict:
    """Where a recipe's `hub:` section pushes, as RUN_DIR/pushed.json records it."""
    return {"repo": hub.repo, "revision": hub.revision, "merged": hub.push == "merged"}


def pending_push(run_dir: str | Path) -> bool:
    """The run's recipe names a Hub repo, and the push of its finished outputs there has not completed."""
    from finetune.recipe import load_recipe

    run_dir = Path(run_dir)
    hub = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True).hub
    if not hub.repo:
        return False
    target, done = _recipe_push(hub), rundir.read_pushed(run_dir)
    return {key: done.get(key) for key in target} != target
