"""distill --force (builder/distill/pipeline.py) swaps the draft in whole, and replaces only a draft the distiller
wrote: never the target, a model it did not write, or a user's folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bundle_edits import _contents, _user_folder


@pytest.fixture
def old_draft(tmp_path):
    from conftest import make_model, make_tokenizer, tiny_config

    folder = tmp_path / "draft"
    make_tokenizer(folder)
    make_model(folder, tiny_config(layers=1), seed=9)
    (folder / "distill_report.json").write_text(json.dumps({"generation": "old"}))
    return folder


def test_an_interrupted_distill_force_keeps_the_old_draft(tiny_pair, old_draft, tmp_path, monkeypatch):
    from builder.distill import save
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    before = {p.name: p.read_bytes() for p in old_draft.iterdir()}
    (tmp_path / "prompts.txt").write_text("\n".join(f"the quick brown fox {i}" for i in range(12)))

    def save_then_die(draft, tokenizer, out, kept, report):
        draft.save_pretrained(str(out))  # the weights are written; the process dies before the rest
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(save, "save_draft", save_then_die)  # publish_draft calls it there
    with pytest.raises(KeyboardInterrupt):
        distill_draft(
            DistillRecipe(init="layers=1", prompts=tmp_path / "prompts.txt", max_new_tokens=4, train_steps=1),
            str(tiny_pair[0]),
            old_draft,
            force=True,
            quiet=True,
        )
    assert {p.name: p.read_bytes() for p in old_draft.iterdir()} == before  # untouched: no new weights, old report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "prompts.txt"]


def test_distill_force_refuses_a_folder_that_is_not_a_draft(tiny_pair, tmp_path):
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    out = tmp_path / "work"
    before = _user_folder(out)
    with pytest.raises(DistillError, match="is not a draft folder .*nothing was touched"):
        distill_draft(DistillRecipe(init="layers=1", train_steps=1), str(tiny_pair[0]), out, force=True, quiet=True)
    assert _contents(out) == before


def _copy_model(source: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(source, dest)
    return dest


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(f"the quick brown fox {i}" for i in range(12)))
    return path


# (what --out is, relative to the target) -> how the test lays it out
BAD_OUTS = [
    "the target itself",
    "the target, spelt with ./",
    "the target through a symbolic link",
    "a folder holding the target",
    "a new folder inside the target",
    "another model folder",
    "an init checkpoint",
    "the folder holding a .gguf target",
    "a model folder with only a weights file",
]


@pytest.mark.parametrize("case", BAD_OUTS)
def test_distill_force_never_replaces_the_target_or_a_model_it_did_not_write(tiny_pair, tmp_path, prompt_file, case):
    from builder.distill.corpus import DistillError
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    models = tmp_path / "models"
    target = _copy_model(tiny_pair[0], models / "target")
    init = "layers=1"
    if case == "the target itself":
        out = target
    elif case == "the target, spelt with ./":
        out = Path(str(models) + "/./target/")
    elif case == "the target through a symbolic link":
        out = tmp_path / "link"
        out.symlink_to(target, target_is_directory=True)
    elif case == "a folder holding the target":
        out = models
    elif case == "a new folder inside the target":
        out = target / "draft"
    elif case == "another model folder":
        out = _copy_model(tiny_pair[1], tmp_path / "my-draft")
    elif case == "an init checkpoint":
        out = _copy_model(tiny_pair[1], tmp_path / "init")
        init = str(out)
    elif case == "the folder holding a .gguf target":
        gguf = models / "target.gguf"
        gguf.write_bytes(b"GGUF")
        target, out = gguf, models
    else:
        out = tmp_path / "weights"
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"\0" * 64)
    before = _contents(models), _contents(out.resolve()) if out.exists() else None
    with pytest.raises(DistillError, match="nothing was touched|symbolic link"):
        distill_draft(
            DistillRecipe(init=init, prompts=prompt_file, max_new_tokens=4, train_steps=1),
            str(target),
            out,
            force=True,
            quiet=True,
        )
    assert (_contents(models), _contents(out.resolve()) if out.exists() else None) == before


def test_distill_force_replaces_its_own_draft(tiny_pair, old_draft, prompt_file):
    """The marker is the distiller's own report: a draft it wrote is replaced (and says so in its new report)."""
    from builder.distill.pipeline import distill_draft
    from builder.distill.recipe import DistillRecipe

    distill_draft(
        DistillRecipe(init="layers=1", prompts=prompt_file, max_new_tokens=4, train_steps=1),
        str(tiny_pair[0]),
        old_draft,
        force=True,
        quiet=True,
    )
    assert json.loads((old_draft / "distill_report.json").read_text()).get("generation") != "old"
