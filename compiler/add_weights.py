"""The weights step: a checkpoint's weights into a bundle's per-rank files.

    deepinfer-compile recipes/full-size/deepseek-v3-671b.yaml --no-weights     # shapes only: config.json
    deepinfer-compile weights artifacts/deepseek-v3-671b --checkpoint /data/DeepSeek-V3 --ranks 0-7

A bundle compiled with --no-weights lists in its manifest what each rank's file will hold
(`weight_specs`); this step streams a released checkpoint (safetensors shards, fp8/fp4 as released)
into those files one tensor at a time, so host memory is bounded by the largest tensor, not the
model. It can run on another machine than the compile, each host for its own ranks. Every file is
written beside its final name and renamed when whole, then recorded in the manifest (sha256 and
size) before the next one starts: after Ctrl-C or a crash the same command finishes what is left
and leaves what is done. The checkpoint is checked against the bundle before anything is written
(its config, then every tensor's presence, shape and dtype, from the file headers): a wrong one
changes nothing.
"""

import os
import tempfile
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from deepinfer.models import check_checkpoint
from deepinfer.models.checkpoint import CheckpointError
from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.manifest import SIGNATURE_FILE, Manifest, read_manifest, sha256_file, sign

from .bundle import output_lock
from .build import weight_reader
from .plan import recipe_layout, recipe_model
from .recipe import Recipe, RecipeError, load_recipe
from .weights import file_bytes, write_rank_file


class WeightsStepError(DeepinferError):
    exit_code = 2  # bad input: the bundle, the checkpoint or the ranks asked for


def add_weights(bundle: Path, checkpoint: Path, ranks: list[int] | None = None, sign_key: bytes | None = None,
                progress: bool = True) -> list[int]:
    """Write the weight files of `ranks` (default: every rank) that the bundle does not have whole;
    returns the ranks written."""
    bundle, checkpoint = Path(bundle), Path(checkpoint)
    with output_lock(bundle):
        manifest = read_manifest(bundle, {}, weights=False)
        world = len(manifest.weight_files)
        ranks = list(range(world)) if ranks is None else ranks
        if not all(0 <= r < world for r in ranks):
            raise WeightsStepError(f"--ranks {ranks[0]}-{ranks[-1]}: the bundle has ranks 0-{world - 1}.")
        if not manifest.weight_specs:
            raise WeightsStepError(f"{bundle}/manifest.json: no weight_specs (a bundle from a deepinfer-compile before the "
                                   "weights step): recompile it.")
        if (bundle / SIGNATURE_FILE).exists() and sign_key is None:
            raise WeightsStepError(f"{bundle / SIGNATURE_FILE}: the bundle is signed, and adding weights changes its manifest: "
                                   "give the deploy key with --sign-key to sign it again.")
        recipe = _recipe_for(manifest, checkpoint, bundle)
        _check_same_model(manifest, recipe_model(recipe, "meta").config.to_dict(), checkpoint, bundle)
        full = recipe_model(recipe, "meta", quantize=False)
        check_checkpoint(checkpoint, full)  # every tensor there, its shape and dtype: before anything is written
        specs = [(w.name, w.shape, getattr(torch, w.dtype)) for w in manifest.weight_specs]
        layout = recipe_layout(recipe)  # (the recipe's parallel: the manifest's)
        read_slice = weight_reader(recipe, full, specs, layout)

        todo = [r for r in ranks if not _whole(bundle, manifest, r)]
        (bundle / "weights").mkdir(exist_ok=True)
        with tqdm(total=len(todo) * file_bytes(specs), unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                  desc=f"weights of {len(todo)} rank(s)") as bar:
            for rank in todo:
                rel = manifest.weight_files[rank]
                final = bundle / rel
                partial = final.with_name(final.name + ".partial")
                bar.set_postfix_str(f"rank {rank}")
                sha256 = write_rank_file(partial, rank, specs, layout, full.config, read_slice, bar.update)
                os.replace(partial, final)
                manifest.files[rel], manifest.sizes[rel] = sha256, final.stat().st_size
                _write_manifest(bundle, manifest, sign_key)
        _write_manifest(bundle, manifest, sign_key)  # (signed again even when nothing was left to write)
        return todo


def parse_ranks(text: str) -> list[int]:
    """"3" or "0-7" (inclusive)."""
    first, _, last = text.partition("-")
    if not (first.isdigit() and (last.isdigit() or not _)):
        raise WeightsStepError(f"--ranks {text!r}: give a rank or an inclusive range, e.g. 0-7.")
    first, last = int(first), int(last or first)
    if last < first:
        raise WeightsStepError(f"--ranks {text!r}: the range is empty.")
    return list(range(first, last + 1))


def _recipe_for(manifest: Manifest, checkpoint: Path, bundle: Path) -> Recipe:
    """The bundle's recipe with `checkpoint` as its model.checkpoint, and the backend its regions
    were compiled with (`--backend` may have overridden the recipe's): some store weights their way."""
    backends = {region.backend for region in manifest.regions.values()}
    raw = {**manifest.recipe, "model": {**manifest.recipe["model"], "checkpoint": str(checkpoint)}}
    raw["model"].pop("config", None)
    if len(backends) == 1:
        raw["backend"] = {**(raw.get("backend") or {}), "name": backends.pop()}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "recipe.yaml"
        path.write_text(yaml.safe_dump(raw))
        try:
            return load_recipe(path, backend_installed=False)
        except RecipeError as err:
            raise WeightsStepError(f"{bundle}: its recipe with --checkpoint {checkpoint}: {str(err).split(': ', 1)[-1]}") from None


def _check_same_model(manifest: Manifest, config: dict, checkpoint: Path, bundle: Path):
    differ = sorted(k for k in set(config) | set(manifest.model_config) if config.get(k) != manifest.model_config.get(k))
    if differ:
        shown = ", ".join(f"{k}: {manifest.model_config.get(k)!r} in the bundle, {config.get(k)!r} there" for k in differ[:4])
        raise CheckpointError(f"{checkpoint / 'config.json'}: not the model {bundle} was compiled for ({shown}"
                              f"{', ...' if len(differ) > 4 else ''}). Give that model's checkpoint, or compile a bundle for this one.")


def _whole(bundle: Path, manifest: Manifest, rank: int) -> bool:
    """Whether rank's file is recorded and on disk with its recorded size and sha256 (streamed:
    never the whole file in memory)."""
    rel = manifest.weight_files[rank]
    if rel not in manifest.files or not (bundle / rel).is_file():
        return False
    return (bundle / rel).stat().st_size == manifest.sizes[rel] and sha256_file(bundle / rel) == manifest.files[rel]


def _write_manifest(bundle: Path, manifest: Manifest, sign_key: bytes | None):
    """manifest.json replaced whole (a crash leaves the old one or the new one), then signed."""
    staged = bundle / "manifest.json.partial"
    staged.write_text(manifest.to_json())
    os.replace(staged, bundle / "manifest.json")
    if sign_key is not None:
        sign(bundle, sign_key)
