"""Reproducible mode of the llama.cpp runtime (fly_serve/runtime/llama_runner.py, "Reproducible"):
a position's logits do not depend on the forward's shape, so a greedy request gives one text.

The choice is process-wide and made once (llama.cpp reads its tiled-matmul switch once), so every
case runs in a child process of its own."""

import json
import subprocess
import sys
import textwrap

import pytest


def child(script: str, timeout_s: float = 900) -> dict:
    """Run script in a fresh Python; its last stdout line is a JSON answer."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_runner_never_runs_a_lone_token_or_a_wide_forward():
    out = child(
        """
        import json
        from fly_serve.loading.loading import load_model
        from fly_serve.runtime import llama_runner as lr
        lr.set_reproducible(True)
        model = load_model("tiny:0", runtime="llama.cpp")
        r = lr.LlamaRunner(model, n_slots=2, budget_tokens=1024, threads=1)
        seq = list(range(5, 45))
        _, fed_prompt = r.feed(["a"], [seq], logits=False)
        logits, fed = r.feed(["a"], [seq + [7]], tail=[1])  # a plain step: the token before goes again
        calls = []
        real = r._decode_chunk
        r._decode_chunk = lambda ids, *a: (calls.append(len(ids)), real(ids, *a))[1]
        r.feed(["b"], [list(range(3, 3 + 33))], logits=False)  # 33 tokens: never 32 + 1
        print(json.dumps({"fed_prompt": fed_prompt, "fed": fed, "shape": list(logits.shape),
                          "calls": calls, "batch": r.batch_tokens, "repacked": model.repacked}))
        """
    )
    assert out["fed"] == [2] and out["shape"][:2] == [1, 1]  # one position's logits, as asked
    assert out["batch"] == 32 and max(out["calls"]) <= 32 and min(out["calls"]) >= 2
    assert sum(out["calls"]) == 33 and out["repacked"] is False


def test_the_choice_is_made_once_before_any_forward():
    out = child(
        """
        import json
        from fly_serve.loading.loading import load_model
        from fly_serve.runtime import llama_runner as lr
        model = load_model("tiny:0", runtime="llama.cpp")
        lr.LlamaRunner(model, n_slots=1, budget_tokens=256, threads=1).feed(["a"], [[1, 2, 3]])
        errors = []
        try:
            lr.set_reproducible(True)  # after a forward chose the kernels
        except RuntimeError as e:
            errors.append(str(e))
        print(json.dumps({"errors": errors, "on": lr.reproducible()}))
        """
    )
    assert out["on"] is False and "first llama.cpp forward" in out["errors"][0]
    out = child(
        """
        import json
        from fly_serve.loading.loading import gguf_path
        from fly_serve.runtime import llama_runner as lr
        repacked = lr.GGUFModel(str(gguf_path("tiny:0")), repack=True)
        lr.set_reproducible(True)
        errors = []
        for attempt in (lambda: lr.LlamaRunner(repacked, n_slots=1, budget_tokens=256, threads=1),
                        lambda: lr.set_reproducible(False)):
            try:
                attempt()
            except RuntimeError as e:
                errors.append(str(e))
        print(json.dumps({"errors": errors}))
        """
    )
    assert "repacked" in out["errors"][0] and "already runs" in out["errors"][1]


@pytest.mark.real
def test_the_real_targets_logits_do_not_depend_on_the_forwards_shape():
    """Q4_K_M on llama.cpp: one-token decodes, one 8-token forward and a decode beside another
    row give every position the same logits, bit for bit; and a greedy request's text is the
    same in ar, spd and strict FLy with k auto, alone and in a batch."""
    out = child(
        """
        import json, torch
        from fly_serve.build import build_engine
        from fly_serve.engine.prompts import chat_prompt
        from fly_bench.prompts import TASKS
        engine = build_engine(runtime="llama.cpp", reproducible=True, calibrate=False, max_batch=4)
        r, tok = engine.scorer.runner, engine.tokenizer
        ids = chat_prompt(tok, TASKS["code"])
        cont = tok.encode("def merge_intervals(intervals):\\n    intervals.sort()", add_special_tokens=False)[:8]
        seq = ids + cont
        r.feed(["a"], [ids], logits=False)
        wide = r.feed(["a"], [seq], tail=[8])[0][0].clone()
        one = torch.stack([r.feed(["a"], [seq[: len(ids) + i + 1]], tail=[1])[0][0, 0].clone() for i in range(8)])
        r.feed(["b"], [tok.encode("Hello there, how are you?", add_special_tokens=False)], logits=False)
        lg, _ = r.feed(["a", "b"], [seq[: len(ids) + 1], r.cache.rows["b"].tokens + [11, 12, 13]], tail=[1, 3])
        r.release(["a", "b"])
        prompts = [chat_prompt(tok, TASKS[t]) for t in ("code", "math", "prose", "rewrite")]
        texts = {}
        for name, knobs in [("ar", dict(mode="ar")), ("spd", dict(mode="spd", k=6)),
                            ("fly", dict(mode="fly", k="auto", theta=1.0))]:
            alone = engine.generate(prompts[:1], dict(knobs, max_tokens=48))[0].generated
            batch = engine.generate(prompts, dict(knobs, max_tokens=48))[0].generated
            texts[name] = [alone, batch]
        print(json.dumps({"wide": (one - wide).abs().max().item(), "beside": (one[0] - lg[0, 0]).abs().max().item(),
                          "texts": texts}))
        """,
        timeout_s=1800,
    )
    assert out["wide"] == 0.0 and out["beside"] == 0.0
    ar = out["texts"]["ar"][0]
    assert all(t == ar for runs in out["texts"].values() for t in runs), out["texts"]
