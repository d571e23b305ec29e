"""llama.cpp's logits for `specserve bench accuracy`, run in llama.cpp's own virtualenv.

    <llamacpp venv>/bin/python llamacpp_logits.py < request.json

Standalone: imports llama_cpp and numpy, never specserve. The request is
{"model": .gguf, "sequences": [[token ids]], "out_dir": dir}; every position's logits of
sequence i go to out_dir/i.npy ([len, vocab], float32), each sequence read in one batch
from an empty cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import llama_cpp
    import numpy as np

    request = json.loads(sys.stdin.read())
    sequences = request["sequences"]
    n_ctx = max(len(s) for s in sequences) + 8
    llm = llama_cpp.Llama(
        model_path=request["model"], n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
        logits_all=True, verbose=False,
    )  # fmt: skip
    for i, ids in enumerate(sequences):
        llm.reset()
        llm.eval(ids)
        np.save(
            Path(request["out_dir"]) / f"{i}.npy", np.asarray(llm.scores[: len(ids)], np.float32)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
