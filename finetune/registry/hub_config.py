"""A Hub model's config.json, and only that file, through huggingface_hub: fetched when online and kept
in the Hugging Face cache, read from that cache when offline (HF_HUB_OFFLINE=1). No weights, no
tokenizer, no torch. Errors say whether the id, the revision, the access or the network is at fault.
"""

from __future__ import annotations

import os
from pathlib import Path

from finetune.errors import RecipeError

CONFIG = "config.json"


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def fetch_config(repo_id: str, *, revision: str | None = None) -> Path:
    """The cached path of `repo_id`'s config.json (downloaded first when online and not cached)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    key, offline = "model.name", constants.HF_HUB_OFFLINE
    try:
        # endpoint and cache read now, not at huggingface_hub's import (a test or a caller may set them later)
        return Path(
            hf_hub_download(
                repo_id,
                CONFIG,
                revision=revision,
                endpoint=os.environ.get("HF_ENDPOINT"),
                cache_dir=os.environ.get("HF_HUB_CACHE"),
            )
        )
    except GatedRepoError:
        raise RecipeError(
            f"{repo_id} is gated: its config.json needs an accepted license and a login",
            key=key,
            hint="accept the license on the model's Hub page and run `hf auth login`, "
            "or set model.arch to a registry entry (finetune models)",
        ) from None
    except RepositoryNotFoundError:
        raise RecipeError(
            f"no model {repo_id!r} on the Hub (or it is private)",
            key=key,
            hint="check the id's spelling; for a private model run `hf auth login`",
        ) from None
    except RevisionNotFoundError:
        raise RecipeError(
            f"{repo_id} has no revision {revision!r}",
            key="model.revision",
            hint="use a branch, tag or commit that exists, or remove model.revision",
        ) from None
    except LocalEntryNotFoundError:
        where = "this machine is offline (HF_HUB_OFFLINE=1)" if offline else "the Hub cannot be reached"
        raise RecipeError(
            f"{where} and {repo_id}'s config.json is not in the Hugging Face cache",
            key=key,
            hint=f"plan once online (only config.json is fetched), run `hf download {repo_id} "
            f"{CONFIG}`, or set model.arch to a registry entry (finetune models)",
        ) from None
    except EntryNotFoundError:
        raise RecipeError(
            f"{repo_id} has no config.json; not a transformers model the planner can read",
            key=key,
            hint="set model.arch to the closest registry entry (finetune models)",
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise RecipeError(
            f"cannot fetch {repo_id}'s config.json: {exc}",
            key=key,
            hint="check the network and the Hub status, or set model.arch",
        ) from None
