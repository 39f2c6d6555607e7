"""Drafter training: the training pass is the inference pass, stages cache and resume, the same
seed gives the same drafter, data parallel matches one process, and a tiny VLM trains end to end."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import glance_rt
from glance_rt import GlanceError
from glance_rt.models.drafter import read_drafter
from glance_rt.round.draft import DraftPass
from glance_rt.tools.train import TrainConfig, train
from glance_rt.tools.training.data import capture_features, choose_draft_vocab
from glance_rt.tools.training.glance import block_forward
from tests.conftest import extend_inputs, hf_greedy, tiny_target
from tests.tiny_models import make_images, make_inputs, make_tiny

PROMPTS = [
    ("extraction", "Copy exactly: the cat sat on the mat."),
    ("extraction", "Repeat: alpha beta gamma delta."),
    ("conversion", "Turn into JSON: name Ann, age 31."),
    ("conversion", "Make a list: apples, pears, plums."),
    ("chat", "Tell me a story about a fox."),
    ("chat", "What do you like about rain?"),
    ("code", "Write a function that adds two numbers."),
    ("extraction", "Copy exactly: one two three."),
    ("chat", "Say hello to the reader."),
]


def write_prompts(path, with_images: bool = False):
    rows = []
    for i, (kind, prompt) in enumerate(PROMPTS):
        row = {"id": f"t{i}", "kind": kind, "prompt": prompt, "split": "heldout" if i >= 7 else "train"}
        if with_images:
            row["images"] = [f"img{i % 2}.png"]
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if with_images:
        for i, im in enumerate(make_images(2)):
            im.save(path.parent / f"img{i}.png")
    return path


def small_cfg(tmp_path, name="run", **kw):
    base = dict(out=str(tmp_path / name), prompts=str(write_prompts(tmp_path / "prompts.jsonl")),
                num_layers=1, block_size=4, response_tokens=16, response_batch=4, steps=6, batch_size=2,
                blocks_per_seq=4, save_every=3, eval_per_kind=1, eval_budget=8, eval_tokens=12, bf16=False)
    base.update(kw)
    return TrainConfig(**base)


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def train_killed_at(monkeypatch, target, cfg, step: int) -> None:
    """`train(target, cfg)` killed (KeyboardInterrupt) as step `step` starts, as a kill would stop it."""
    import glance_rt.tools.training.loop as tm

    real_lr = tm.lr_at

    def crash(s, c):
        if s == step:
            raise KeyboardInterrupt("killed")
        return real_lr(s, c)

    monkeypatch.setattr(tm, "lr_at", crash)
    with pytest.raises(KeyboardInterrupt):
        train(target, cfg)
    monkeypatch.setattr(tm, "lr_at", real_lr)


@pytest.mark.parametrize(("arch", "copy_head"), [("llama", False), ("qwen2_5_vl", False), ("llama", "rows"),
                                                 ("llama", "span")])
def test_training_pass_is_the_inference_pass(arch, copy_head):
    """block_forward (many anchored blocks, block-sparse mask) == DraftPass (cache, one block); with a
    copy head (per row, or in span form), the training mixture (`copy_logprobs`) == the draft pass's,
    pointing at the same rows."""
    from glance_rt.tools.training.data import Sequence
    from glance_rt.tools.training.glance import copy_logprobs

    target, model, processor = tiny_target(arch)
    inputs = make_inputs(arch, processor)
    ref = hf_greedy(model, inputs, 16)
    learned = arch == "qwen2_5_vl"  # one case masks with a learned embedding, the other with a token's (DFlash)
    drafter = glance_rt.init_drafter(target, num_layers=2, block_size=5, seed=3, learned_mask=learned,
                                     copy_head=bool(copy_head), copy_span=copy_head == "span").float()
    if learned:
        with torch.no_grad():
            torch.nn.init.normal_(drafter.mask_embedding)
    full = extend_inputs(inputs, ref)
    feats = capture_features(target, full, drafter.target_layer_ids)
    ids = full["input_ids"][0]
    p = inputs["input_ids"].shape[1]
    anchors = torch.tensor([p, p + 3, p + 10, len(ids) - 2])
    embed = target.parts.text_model.embed_tokens.weight
    with torch.no_grad():
        out = block_forward(drafter, embed, feats, ids, anchors)  # [K, B-1, H]
        train_logits = target.parts.lm_head(out)
        if copy_head:
            plain = train_logits.log_softmax(-1)
            train_logits = copy_logprobs(drafter, out, train_logits, Sequence(feats, ids, p, "chat"), anchors)
            assert (train_logits - plain).abs().max() > 0.1  # the pointer moves the distribution
        for k, a in enumerate(anchors.tolist()):
            dp = DraftPass(drafter, target.parts.text_model.embed_tokens, target.parts.lm_head, 256)
            serve_logits = dp(feats[:a], 0, int(ids[a]), a, ctx_tokens=ids[1 : a + 1] if copy_head else None)
            torch.testing.assert_close(train_logits[k], serve_logits, rtol=1e-4, atol=1e-3)


def test_end_to_end_resume_and_reproducibility(tmp_path, monkeypatch):
    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, "a", draft_vocab=40)
    drafter, result = train(target, cfg)
    out = tmp_path / "a"
    assert drafter.config.draft_vocab_size == 40  # the 40 most frequent response tokens
    assert torch.equal(drafter.draft_vocab, choose_draft_vocab(out, 1, 40, target.vocab_size))
    assert sorted(p.name for p in (out / "responses").iterdir()) == ["heldout.jsonl", "part-00000.jsonl"]
    assert sorted(p.name for p in (out / "features").iterdir()) == ["heldout.safetensors", "part-00000.safetensors"]
    history = json.loads((out / "history.json").read_text())
    assert [e["step"] for e in history["steps"]] == [3, 6]  # every checkpoint scored on the held-out set
    assert all(e["heldout_loss"] > 0 and 1 <= e["heldout_tau_chain"] <= cfg.block_size for e in history["steps"])
    best = out / "checkpoints" / f"step-{history['best_step']:06d}"
    assert all(torch.equal(v.to(torch.bfloat16), weights(out / "drafter")[k]) for k, v in weights(best).items())
    assert (out / "drafter" / "config.json").exists() and (out / "eval.json").exists()
    assert set(result["kinds"]) == {"extraction", "chat"}  # the held-out kinds
    assert result["overall"]["tau"] >= 1.0
    assert result["overall"]["draft_passes"] == result["overall"]["rounds"] > 20  # tau of the drafter: no gate
    alone = result["drafter_alone"]  # beside the default method: the drafter with no lookup chain
    assert alone["lookup"] == 0 and result["lookup"] > 0
    assert alone["overall"]["draft_passes"] == alone["overall"]["rounds"] > 20
    # the trained drafter loads for the target and decodes losslessly
    loaded = glance_rt.load_drafter(out / "drafter", target)
    _, model, tok = tiny_target("llama")
    inputs = make_inputs("llama", tok)
    assert glance_rt.Decoder(target, loaded).generate(max_new_tokens=16, **inputs).token_ids == hf_greedy(
        model, inputs, 16)

    # same seed, new folder: the same drafter, bit for bit
    train(target, replace(cfg, out=str(tmp_path / "b")))
    wa, wb = weights(out / "drafter"), weights(tmp_path / "b" / "drafter")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # killed after the step-3 checkpoint, then resumed: the same drafter, no stage redone
    train_killed_at(monkeypatch, target, replace(cfg, out=str(tmp_path / "c")), step=4)
    assert (tmp_path / "c" / "checkpoints" / "step-000003" / "trainer.pt").exists()
    assert not (tmp_path / "c" / "drafter").exists()
    stamp = (tmp_path / "c" / "responses" / "part-00000.jsonl").stat().st_mtime_ns
    with pytest.raises(GlanceError, match="--resume"):
        train(target, replace(cfg, out=str(tmp_path / "c")))
    train(target, replace(cfg, out=str(tmp_path / "c"), resume=True))
    assert (tmp_path / "c" / "responses" / "part-00000.jsonl").stat().st_mtime_ns == stamp
    wc = weights(tmp_path / "c" / "drafter")
    assert all(torch.equal(wa[k], wc[k]) for k in wa)


def test_refuses_other_runs_and_bad_images(tmp_path):
    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, steps=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x.txt").write_text("mine")
    with pytest.raises(GlanceError, match="not empty"):
        train(target, replace(cfg, out=str(tmp_path / "busy")))
    train(target, cfg)
    with pytest.raises(GlanceError, match="different run"):
        train(target, replace(cfg, block_size=3, resume=True))
    vlm, _, _ = tiny_target("qwen2_vl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "What is it?", "images": ["missing.png"]}) + "\n")
    with pytest.raises(GlanceError, match="missing.png"):
        train(vlm, replace(cfg, out=str(tmp_path / "v"), prompts=str(bad), images=str(tmp_path)))


def test_tiny_vlm_trains_end_to_end_with_images(tmp_path):
    """Rendered-image prompts from the corpus (text, tables, charts, shapes) through the processor."""
    from tests.conftest import corpus_builder

    save_image_prompts, write_corpus = corpus_builder().save_image_prompts, corpus_builder().write_corpus

    target, _, _ = tiny_target("qwen2_5_vl")
    rows = save_image_prompts(8, tmp_path / "imgs")
    rows[-1]["split"] = rows[-2]["split"] = "heldout"
    prompts = write_corpus(tmp_path / "vlm.jsonl", rows)
    cfg = small_cfg(tmp_path, "vlm", prompts=str(prompts), images=str(tmp_path / "imgs"))
    drafter, result = train(target, cfg)
    assert result["overall"]["rounds"] > 0
    from safetensors import safe_open

    with safe_open(tmp_path / "vlm" / "features" / "part-00000.safetensors", "pt") as f:
        rows = json.loads(f.metadata()["rows"])
        ids = f.get_tensor(f"{rows[0]['key']}.ids")
    assert (ids == target.parts.image_token_id).sum() > 0  # image positions are in the context


@pytest.mark.full
def test_data_parallel_two_processes_matches_one(tmp_path):
    model, processor = make_tiny("llama")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    prompts = write_prompts(tmp_path / "p.jsonl")
    args = ["--target", str(folder), "--prompts", str(prompts), "--num-layers", "1", "--block-size", "4",
            "--response-tokens", "16", "--response-batch", "4", "--steps", "4", "--batch-size", "4",
            "--blocks-per-seq", "4", "--save-every", "2", "--eval-per-kind", "1", "--eval-budget", "4", "--no-bf16",
            "--lr", "1e-2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "glance_rt.cli", "train", "--out", str(tmp_path / "one"), *args],
                         env=env, capture_output=True, text=True)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", "29517", "-m", "glance_rt.cli", "train", "--out", str(tmp_path / "two"),
                          *args],
                         env=env, capture_output=True, text=True)
    assert two.returncode == 0, two.stderr[-3000:]
    # fp32 checkpoints after the last step: equal up to float reduction order, while a rank that
    # trained on its half of the batch alone would be off by ~lr per step
    last = "checkpoints/step-000004"
    w1, w2 = weights(tmp_path / "one" / last), weights(tmp_path / "two" / last)
    w0 = weights(tmp_path / "one" / "checkpoints" / "step-000002")
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=2e-5)
    assert max((w1[k] - w0[k]).abs().max().item() for k in w1) > 5e-3  # and training moved the weights


def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import errno

    import glance_rt.tools.training.loop as tm

    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, "full")
    real_save = torch.save

    def save(obj, path, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(tm.torch, "save", save)
    with pytest.raises(GlanceError, match="step-000003.*intact.*--resume"):
        train(target, cfg)
    out = tmp_path / "full"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003"]
    kept = out / "checkpoints" / "step-000003"
    ckpt = glance_rt.load_drafter(kept, target)  # a complete drafter folder, for this target
    assert (ckpt.config.block_size, ckpt.config.num_hidden_layers) == (cfg.block_size, cfg.num_layers)
    saved, loaded = weights(kept), ckpt.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp leftovers
    monkeypatch.setattr(tm.torch, "save", real_save)
    train(target, replace(cfg, resume=True))
    assert (out / "drafter" / "model.safetensors").exists()


def test_draft_vocab_is_the_most_frequent_response_tokens(tmp_path):
    rows = [{"response_ids": [5, 5, 5, 9, 9, 2, 7]}, {"response_ids": [7, 9, 3, 3]}, {"response_ids": []}]
    (tmp_path / "responses").mkdir()
    (tmp_path / "responses" / "part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # counts: 5:3, 9:3, 3:2, 7:2, 2:1; ties broken by the smaller id (3 before 7); returned sorted
    assert choose_draft_vocab(tmp_path, 1, 3, 12).tolist() == [3, 5, 9]
    assert choose_draft_vocab(tmp_path, 1, 5, 12).tolist() == [2, 3, 5, 7, 9]
    assert choose_draft_vocab(tmp_path, 1, 7, 12).tolist() == [0, 1, 2, 3, 5, 7, 9]  # then unseen ids
    assert choose_draft_vocab(tmp_path, 1, 12, 12) is None and choose_draft_vocab(tmp_path, 1, None, 12) is None


def test_init_from_continues_a_glance_only_drafter_in_dflash_form(tmp_path):
    """--init-from copies every tensor the two drafters share; a learned mask and a draft vocabulary the
    new run does not use are dropped (how a glance-only drafter is continued into DFlash form)."""
    from glance_rt.models.drafter import check_dflash
    from glance_rt.tools.training.glance import start_from
    from tests.conftest import vocab_drafter

    target, _, _ = tiny_target("llama")
    vocab_drafter(target, 64, seed=3, learned_mask=True).save(tmp_path / "src")
    src = read_drafter(tmp_path / "src")
    dst = glance_rt.init_drafter(target, seed=9).float()
    start_from(dst, tmp_path / "src")
    assert set(dst.state_dict()) == set(src.state_dict()) - {"mask_embedding", "draft_vocab"}
    for k, v in dst.state_dict().items():
        assert torch.equal(v, src.state_dict()[k]), k
    check_dflash(dst)
    with pytest.raises(GlanceError, match="num_hidden_layers"):
        start_from(glance_rt.init_drafter(target, num_layers=2), tmp_path / "src")


def test_online_features_train_the_same_drafter_as_cached_ones(tmp_path):
    """--features online: no feature cache, the target computes each step's features (and, with
    --distill, its top-K), by the same modules as the feature stage: the same drafter bit for bit, and
    the same held-out history."""
    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, "cached", distill=3)
    train(target, cfg)
    train(target, replace(cfg, out=str(tmp_path / "online"), features="online"))
    assert not (tmp_path / "online" / "features").exists()
    wa, wb = weights(tmp_path / "cached" / "drafter"), weights(tmp_path / "online" / "drafter")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ha, hb = (json.loads((tmp_path / n / "history.json").read_text()) for n in ("cached", "online"))
    assert ha == hb


def test_the_best_checkpoint_by_heldout_loss_is_kept_and_shipped(tmp_path, monkeypatch):
    import glance_rt.tools.training.loop as tm

    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, steps=12)
    scores = iter([0.9, 0.5, 0.7, 0.8])  # held-out loss at steps 3, 6, 9, 12: step 6 is the best
    monkeypatch.setattr(tm.Trainer, "validate", lambda self: {"heldout_loss": next(scores), "heldout_tau_chain": 1.0})
    train(target, cfg)
    out = tmp_path / "run"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000006", "step-000009", "step-000012"]
    history = json.loads((out / "history.json").read_text())
    assert history["best_step"] == 6 and [e["heldout_loss"] for e in history["steps"]] == [0.9, 0.5, 0.7, 0.8]
    best, last = weights(out / "checkpoints" / "step-000006"), weights(out / "checkpoints" / "step-000012")
    shipped = weights(out / "drafter")
    assert all(torch.equal(v.to(torch.bfloat16), shipped[k]) for k, v in best.items())
    assert not all(torch.equal(v.to(torch.bfloat16), shipped[k]) for k, v in last.items())


def test_until_responses_fills_the_store_then_a_resume_trains(tmp_path):
    from glance_rt.tools.store import ResponseStore, store_key

    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, store=str(tmp_path / "store"), until="responses")
    assert train(target, cfg) == (None, None)
    out = tmp_path / "run"
    assert not (out / "features").exists() and not (out / "checkpoints").exists()
    assert len(ResponseStore(tmp_path / "store", store_key(target, cfg.response_tokens))) == len(PROMPTS)
    drafter, result = train(target, replace(cfg, until="train", resume=True))
    assert (out / "drafter" / "model.safetensors").exists() and result["overall"]["tau"] >= 1.0


def test_training_rows_take_the_kinds_in_turn():
    from glance_rt.tools.training.data import training_rows

    kinds = [("a", "train"), ("a", "train"), ("a", "train"), ("b", "train"), ("b", "heldout"), ("c", "train")]
    rows = [{"kind": k, "split": s, "id": str(i)} for i, (k, s) in enumerate(kinds)]
    assert [r["id"] for r in training_rows(rows, None)] == ["0", "3", "5", "1", "2"]
    assert [r["id"] for r in training_rows(rows, 1)] == ["0", "3", "5"]


def test_data_curve_takes_each_runs_best_checkpoint_by_its_training_length(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import data_curve

    def run(folder, per_kind, steps, best):
        hist = {"best_step": best, "steps": [{"step": s, "heldout_loss": 6.0 - s / 1000 + (s == best) * -1,
                                              "heldout_tau_chain": 1 + s / 1000} for s in steps]}
        (folder / f"per-kind-{per_kind}").mkdir(parents=True)
        (folder / f"per-kind-{per_kind}" / "history.json").write_text(json.dumps(hist))

    run(tmp_path / "a", 400, (100, 200), 100)
    run(tmp_path / "a", 25, (100, 200), 200)
    run(tmp_path / "b", 100, (500, 1000), 500)
    lines = data_curve.curve_points([tmp_path / "a", tmp_path / "b"], kinds=5)
    assert lines == {200: [(125, 6.0 - 0.2 - 1, 1.2), (2000, 6.0 - 0.1 - 1, 1.1)], 1000: [(500, 6.0 - 0.5 - 1, 1.5)]}


@pytest.mark.full
def test_ablation_script_runs_each_variant_once_and_summarises(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import ablate

    model, processor = make_tiny("llama")
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    common = ["--target", str(tmp_path / "model"), "--prompts", str(write_prompts(tmp_path / "prompts.jsonl")),
              "--num-layers", "1", "--response-tokens", "12", "--steps", "4", "--save-every", "2",
              "--eval-per-kind", "1", "--no-bf16", "--features", "online", "--eval-every", "2"]
    out = tmp_path / "abl"
    assert ablate.main(["--out", str(out), "--vary", "block-size=2,4", "--", *common]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["value"] for r in summary["runs"]] == ["2", "4"]
    for r in summary["runs"]:  # --eval-every 2: a point at step 2, then the end's eval.json at step 4
        assert [p[0] for p in r["curve"]] == [2, 4] and r["curve"][-1][1:] == [r["tau"], r["tau_alone"]]
        assert all(tau >= 1.0 for p in r["curve"] for tau in p[1:])
    assert (out / "curve.png").stat().st_size > 0
    runs = [str(out / "block-size-4"), str(out / "block-size-2")]  # finished folders, summarised by name
    assert ablate.main(["--out", str(tmp_path / "cmp"), "--runs", *runs]) == 0
    again = json.loads((tmp_path / "cmp" / "summary.json").read_text())["runs"]
    assert [r["value"] for r in again] == ["block-size-4", "block-size-2"]
    assert [r["curve"] for r in again] == [r["curve"] for r in reversed(summary["runs"])]
    assert (tmp_path / "cmp" / "curve.png").stat().st_size > 0
    for r in summary["runs"]:
        cfg = json.loads((out / f"block-size-{r['value']}" / "eval.json").read_text())["config"]
        assert cfg["block_size"] == int(r["value"]) and cfg["features"] == "online"
        assert r["responses"] == 7 and r["tau"] >= 1.0 and r["tau_alone"] >= 1.0 and r["best_step"] in (2, 4)
    table = (out / "summary.md").read_text().splitlines()
    assert len(table) == 4 and table[0].count("|") == table[1].count("|")  # one separator per column
    stamp = (out / "block-size-2" / "eval.json").stat().st_mtime_ns
    ablate.main(["--out", str(out), "--vary", "block-size=2,4", "--", *common])  # finished runs are not redone
    assert (out / "block-size-2" / "eval.json").stat().st_mtime_ns == stamp


def test_distillation_targets_are_the_targets_own_distribution(tmp_path):
    """--distill K: each response token's teacher is the target's top-K at the row before it, whose first
    entry is the greedy token; at K = 1 the soft CE is exactly the CE on that token, and at K > 1 it is
    another loss (the ranks below the top-1 count)."""
    from glance_rt.tools.training.data import read_sequences, with_features
    from glance_rt.tools.training.glance import block_loss

    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path, distill=4)
    train(target, replace(cfg, until="responses"))
    layers = (0, 1)
    seqs = read_sequences(tmp_path / "run" / "responses" / "part-00000.jsonl", cfg)[:3]
    seqs = [with_features(target, cfg, s, layers) for s in seqs]
    for s in seqs:
        ids, logp = s.teacher
        assert ids.shape == logp.shape == (len(s.ids) - s.prompt_len, 4)
        assert torch.equal(ids[:, 0].long(), s.ids[s.prompt_len :])  # the greedy answer is the top-1
        assert torch.allclose(logp.exp().sum(-1), torch.ones(len(ids)))
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=1, target_layer_ids=layers).float()
    embed = target.parts.text_model.embed_tokens.weight.float()
    head = target.parts.lm_head.weight.float()
    picks = [(s, torch.arange(s.prompt_len, len(s.ids) - 1)) for s in seqs]
    ce = block_loss(drafter, embed, head, picks, 7.0)
    top1 = [(replace(s, teacher=(s.teacher[0][:, :1], torch.zeros(len(s.teacher[0]), 1))), a) for s, a in picks]
    soft1 = block_loss(drafter, embed, head, top1, 7.0, soft=True)
    torch.testing.assert_close(soft1[0], ce[0], rtol=1e-5, atol=1e-4)
    assert soft1[1:] == ce[1:]
    soft4 = block_loss(drafter, embed, head, picks, 7.0, soft=True)
    assert abs(float(soft4[0] - ce[0])) > 1e-3 * float(ce[0])


def test_init_layers_start_the_drafter_from_the_targets_own_layers():
    """--init-layers: drafter layer i holds target layer j_i's weights, its q/k norms the target's query
    and key scale, and its context rows are exactly what target layer j_0 reads (the normed output of
    layer j_0 - 1, one of the drafter's target layers)."""
    from glance_rt.tools.training.data import Sequence
    from glance_rt.tools.training.glance import start_from_target

    target, model, _ = tiny_target("llama")
    row = {"prompt": PROMPTS[0][1]}
    inputs = target.encode_chat(row["prompt"])
    ref = hf_greedy(model, inputs, 12)
    row["response_ids"] = ref
    drafter = glance_rt.init_drafter(target, num_layers=1, block_size=4, seed=2, target_layer_ids=(0, 1)).float()
    seq = Sequence(None, torch.tensor(inputs["input_ids"][0].tolist() + ref), inputs["input_ids"].shape[1], "chat", row)
    start_from_target(drafter, target, (1,), [seq])
    layer = target.parts.text_model.layers[1]
    for k, v in layer.state_dict().items():
        assert torch.equal(drafter.state_dict()[f"layers.0.{k}"], v), k
    q_norm = drafter.layers[0].self_attn.q_norm.weight
    assert torch.all(q_norm == q_norm[0]) and float(q_norm[0]) != 1.0  # one scale: the queries' mean RMS
    full = extend_inputs(inputs, ref)
    feats = capture_features(target, full, (0, 1))  # [L, 2H]
    with torch.no_grad():
        want = layer.input_layernorm(feats[:, : feats.shape[1] // 2])  # layer 1's input: layer 0's output, normed
        torch.testing.assert_close(drafter.context(feats), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(GlanceError, match="one target layer"):
        start_from_target(drafter, target, (0, 1), [seq])


def test_resume_with_more_steps_continues_a_finished_run(tmp_path):
    """A finished run resumed with a larger --steps trains on from its last checkpoint (and writes
    drafter/ and eval.json again); with fewer steps it is refused by name."""
    target, _, _ = tiny_target("llama")
    cfg = small_cfg(tmp_path)
    train(target, cfg)
    out = tmp_path / "run"
    with pytest.raises(GlanceError, match="--steps 3 is fewer"):
        train(target, replace(cfg, steps=3, resume=True))
    train(target, replace(cfg, resume=True))  # the same steps: nothing to do
    assert [e["step"] for e in json.loads((out / "history.json").read_text())["steps"]] == [3, 6]
    _, result = train(target, replace(cfg, steps=9, resume=True))
    assert [e["step"] for e in json.loads((out / "history.json").read_text())["steps"]] == [3, 6, 9]
    assert (out / "checkpoints" / "step-000009").exists()
    assert json.loads((out / "eval.json").read_text())["config"]["steps"] == 9 == result["config"]["steps"]
    assert not any(p.name.endswith(".old") for p in out.iterdir())

