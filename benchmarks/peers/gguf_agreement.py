"""dresd's next-token choices and perplexity on a GGUF file, against llama.cpp's on the same file.

    llama-perplexity -m FILE -f TEXT -c 512 --kl-divergence-base LOGITS   (llama.cpp's run)
    PYTHONPATH=src python benchmarks/peers/gguf_agreement.py FILE LOGITS --llama-ppl X

llama-perplexity's logits file holds the tokens it read (its own tokenization of TEXT, in
chunks of n_ctx, the first of each chunk replaced by BOS where the file asks for one) and, for
the second half of each chunk, every position's log-probabilities over the vocabulary (16-bit,
as its header says). dresd reads the same tokens, runs each chunk teacher-forced through its
own forward on the file's quantized weights, and counts:
  - top-1 agreement: positions where dresd's most likely next token is llama.cpp's, over all
    positions and over those that are no near-tie in llama.cpp's own log-probabilities;
  - perplexity: exp(mean negative log-likelihood of the actual next token), over the same
    positions llama-perplexity scores.
One JSON line; the shell script that runs both writes the table.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from dresd.decoding.forward import Segment, make_forward
from dresd.host import cpu_model
from dresd.models.target import load_target

# A position whose two best next tokens are this close (in llama.cpp's log-probabilities) is a
# near-tie: rounding differences between any two engines may pick either.
NEAR_TIE = 0.05


def read_llama_logits(path: str) -> tuple[int, int, np.ndarray, list[np.ndarray],
                                           list[np.ndarray]]:
    """(n_ctx, n_vocab, tokens [chunks, n_ctx], per chunk llama.cpp's top-1 at each scored
    position, and its margin: the top-1's log-probability minus the runner-up's, in nats)."""
    data = np.fromfile(path, dtype=np.uint8)
    assert data[:8].tobytes() == b"_logits_", "not a llama-perplexity logits file"
    n_ctx, n_vocab, n_chunk = np.frombuffer(data[8:20].tobytes(), np.int32)
    offset = 20 + 4 * n_chunk * n_ctx
    tokens = np.frombuffer(data[20:offset].tobytes(), np.int32).reshape(n_chunk, n_ctx)
    row = 2 * ((n_vocab + 1) // 2) + 4  # uint16 per row: 2 floats, then the vocabulary
    scored = n_ctx - 1 - n_ctx // 2
    body = np.frombuffer(data[offset:].tobytes(), np.uint16)
    body = body[:n_chunk * scored * row].reshape(n_chunk, scored, row)
    top1, margins = [], []
    for chunk in body:
        scale = np.ascontiguousarray(chunk[:, :2]).view(np.float32)[:, 0]  # nats per step
        values = chunk[:, 4:4 + n_vocab]
        best_two = np.sort(values, axis=1)[:, -2:].astype(np.float64)
        top1.append(values.argmax(-1))
        margins.append((best_two[:, 1] - best_two[:, 0]) * scale)
    return int(n_ctx), int(n_vocab), tokens, top1, margins


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the GGUF file")
    parser.add_argument("logits", help="llama-perplexity --kl-divergence-base output")
    parser.add_argument("--llama-ppl", type=float, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", default=None,
                        help="another llama-perplexity logits file of the same text: llama.cpp's "
                             "agreement with itself, nothing of dresd's run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n_ctx, _, tokens, llama_top1, margins = read_llama_logits(args.logits)
    if args.against:  # llama.cpp against itself (another batch size): its own agreement
        _, _, _, other, _ = read_llama_logits(args.against)
        same = sum(int((a == b).sum()) for a, b in zip(llama_top1, other, strict=True))
        print(json.dumps({"logits": args.logits, "against": args.against,
                          "top1_agreement": same / sum(len(a) for a in llama_top1)}))
        return
    target = load_target(args.model)
    forward = make_forward(target.model)
    first = n_ctx // 2
    agree = total = clear = clear_agree = 0
    nll = 0.0
    started = time.perf_counter()
    for chunk, theirs, margin in zip(tokens, llama_top1, margins, strict=True):
        sequence = forward.new_sequence()
        [out] = forward([Segment(sequence, chunk.tolist(), 0)])
        logits = out.logits[first:n_ctx - 1].float()
        targets = torch.from_numpy(chunk[first + 1:].astype(np.int64))
        nll -= torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum().item()
        same = logits.argmax(-1).numpy() == theirs
        agree += int(same.sum())
        total += len(theirs)
        clear += int((margin >= NEAR_TIE).sum())
        clear_agree += int(same[margin >= NEAR_TIE].sum())
    record = {"model": args.model, "linears": target.linears, "cpu": cpu_model(),
              "n_ctx": n_ctx, "chunks": len(tokens), "positions": total,
              "top1_agreement": agree / total, "dresd_ppl": math.exp(nll / total),
              "near_tie_nats": NEAR_TIE, "share_not_near_tie": clear / total,
              "top1_agreement_not_near_tie": clear_agree / max(clear, 1),
              "llama_ppl": args.llama_ppl, "seconds": time.perf_counter() - started}
    if args.llama_ppl:
        record["ppl_ratio"] = record["dresd_ppl"] / args.llama_ppl
    print(json.dumps(record))


if __name__ == "__main__":
    main()
