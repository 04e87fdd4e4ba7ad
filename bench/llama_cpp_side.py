"""llama.cpp's side of ``llama_cpp_reference.py``, run in the Python that has
``llama-cpp-python`` (a venv of its own: it compiles llama.cpp from source). It imports
neither mlx nor mlxq. Reads one JSON request on stdin, writes one JSON answer as stdout's last line:

- ``{"op": "generate", "model", "prompts": [[ids]], "max_tokens", "eos": [ids]}``: greedy
  tokens for each prompt (the ids are passed as they are: no BOS added, no template), with
  the top two logits at every step;
- ``{"op": "quantize", "source", "dest", "ftype"}``: llama.cpp's own quantizer, e.g.
  ``LLAMA_FTYPE_MOSTLY_Q4_K_M`` from an F32 GGUF.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

try:
    import llama_cpp
except ImportError:
    sys.exit(
        "llama_cpp is missing: CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python "
        "numpy in a venv of its own, then pass its python as --llama-python"
    )
import numpy as np


def no_repacking() -> None:
    """Models load without llama.cpp's extra buffer types (weights repacked for AMX and
    other kernels): a GGML_NATIVE build's AMX matmul segfaulted on this machine's CPU
    (Sapphire Rapids class, in a sandbox). The plain CPU kernels compute the same dot
    products (Q8-quantized activations against the weights' blocks)."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params


def top2(logits: np.ndarray) -> list[list[float]]:
    """``[[id, logit], [id, logit]]``, best first."""
    best = np.argpartition(logits, -2)[-2:]
    best = best[np.argsort(-logits[best])]
    return [[int(t), float(logits[t])] for t in best]


def generate(req: dict[str, Any]) -> dict[str, Any]:
    """Greedy continuations of each prompt, stopping after an EOS id or max_tokens."""
    if not req.get("repack", False):
        no_repacking()
    longest = max(len(p) for p in req["prompts"]) + req["max_tokens"] + 1
    llm = llama_cpp.Llama(
        model_path=req["model"],
        n_ctx=max(512, longest),
        n_batch=512,
        n_threads=int(req.get("threads", 2)),
        logits_all=False,
        verbose=False,
    )
    eos = set(req["eos"])
    runs = []
    for prompt in req["prompts"]:
        llm.reset()  # eval drops the cache past n_tokens (0 here) before it writes
        llm.eval(prompt)
        tokens, tops = [], []
        for _ in range(req["max_tokens"]):
            # With logits_all off llama.cpp computes (and Llama.eval keeps) no other rows.
            last = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            logits = np.ctypeslib.as_array(last, shape=(llm.n_vocab(),)).copy()
            tops.append(top2(logits))
            tokens.append(tops[-1][0][0])
            if tokens[-1] in eos:
                break
            llm.eval([tokens[-1]])
        runs.append({"tokens": tokens, "top2": tops})
    return {"runs": runs, "llama_cpp": llama_cpp.__version__}


def quantize(req: dict[str, Any]) -> dict[str, Any]:
    """Quantize ``source`` into ``dest`` with llama.cpp's quantizer (its type choices)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, req["ftype"])
    params.nthread = int(req.get("threads", 2))
    params.allow_requantize = bool(req.get("allow_requantize", False))
    rc = llama_cpp.llama_model_quantize(
        req["source"].encode(), req["dest"].encode(), ctypes.byref(params)
    )
    if rc != 0:
        sys.exit(f"llama_model_quantize {req['source']} -> {req['dest']} failed ({rc})")
    return {"dest": req["dest"], "llama_cpp": llama_cpp.__version__}


def main() -> None:
    req = json.load(sys.stdin)
    answer = {"generate": generate, "quantize": quantize}[req["op"]](req)
    # The answer is stdout's last line (llama.cpp may log there before it).
    sys.stdout.write("\n" + json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
