"""`fly-serve generate` as a user runs it: the installed command in a process of its own, on the
tiny pair. Its streamed text is the in-process engine's under the served profile's defaults, its
stats line names the knobs it decoded with and why it stopped (by default the served profile's:
strict FLy, k auto; loose only when asked), and a bad knob is an error naming the field, not a
traceback."""

import json
import shutil
import subprocess

import pytest

from fly_cli.main import served_defaults
from fly_serve.build import build_engine

PAIR = ["--target", "tiny:0", "--drafter", "tiny:1", "--drafter-precision", "fp32"]
PROMPT = "def add(a, b):"


def fly_serve(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("fly-serve")
    assert exe, "the fly-serve command is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["fly", "ar"])
def test_generate_prints_the_engines_text_and_its_stats(mode):
    done = fly_serve("generate", PROMPT, "--raw", "--mode", mode, "--k", "4", "--max-tokens", "12", *PAIR)
    assert done.returncode == 0, done.stderr
    drafter = "tiny:1" if mode == "fly" else None
    engine = build_engine(
        "tiny:0", drafter, drafter_precision="fp32", max_batch=1, defaults=served_defaults(), calibrate=False
    )
    [want] = engine.generate([PROMPT], [dict(mode=mode, k=4, max_tokens=12)])
    assert done.stdout == want.text + "\n"
    stats = json.loads(done.stderr.strip().splitlines()[-1])
    assert stats["mode"] == mode and stats["finish_reason"] == want.finish_reason
    assert stats["emitted"] == len(want.generated)


def test_generate_names_a_bad_knob():
    done = fly_serve("generate", PROMPT, "--raw", "--mode", "fly", "--theta", "7", *PAIR)
    assert done.returncode != 0
    assert "error:" in done.stderr and "theta" in done.stderr and "Traceback" not in done.stderr


def test_generate_refuses_a_precision_that_llama_cpp_cannot_give_and_names_the_flag():
    """llama.cpp runs a GGUF file at its own quantization: --dtype fp32 there is refused, never
    silently run at the file's (with --runtime auto it loads the target on torch at fp32:
    tests/test_llama_runtime.py)."""
    done = fly_serve("generate", PROMPT, "--raw", "--target", "tiny:0", "--drafter", "tiny:1", "--runtime", "llama.cpp")
    assert done.returncode == 0, done.stderr  # the same pair on llama.cpp at its own precision runs
    done = fly_serve(
        *["generate", PROMPT, "--raw", "--target", "tiny:0", "--drafter", "tiny:1"],
        "--runtime",
        "llama.cpp",
        "--dtype",
        "fp32",
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "error: dtype: runtime llama.cpp" in done.stderr and "fp32" in done.stderr


def test_generate_decodes_as_the_served_profile_by_default_and_loosely_only_when_asked():
    served = served_defaults()
    done = fly_serve("generate", PROMPT, "--raw", "--max-tokens", "8", *PAIR)
    assert done.returncode == 0, done.stderr
    knobs = json.loads(done.stderr.strip().splitlines()[-1])["knobs"]
    assert {name: knobs[name] for name in ("mode", "k", "k_max", "theta", "window")} == {
        name: served[name] for name in ("mode", "k", "k_max", "theta", "window")
    }
    assert served["theta"] >= 1 and knobs["loose"] is False  # strict: the target's own text
    loose = fly_serve("generate", PROMPT, "--raw", "--max-tokens", "8", "--theta", "0.3", "--k", "4", *PAIR)
    assert loose.returncode == 0, loose.stderr
    knobs = json.loads(loose.stderr.strip().splitlines()[-1])["knobs"]
    assert knobs["loose"] is True and knobs["theta"] == 0.3 and knobs["window"] == 3  # the profile's 6 fits no k 4
