"""How far this engine's prompt logprobs (a completion's `echo` with `logprobs`: what lm-evaluation-harness reads) are
from transformers' on the same weights, for each --kv-dtype, and what each costs in decode speed.

    python bench/echo_logprobs.py [--gguf FILE.gguf] [--texts N]

The weights: the default model's GGUF (SmolLM2-135M-Instruct Q4_1; the engine holds its Q4_1 blocks exactly as
int4-g32 and its head as the embedding's Q8_0 blocks) or --gguf; transformers reads the same file (it dequantizes
the blocks to float32). The engine's logprobs are the server's echo path: a prefill through the cache from slot 0
(keys and values stored in the cache's dtype, then read back by the attention kernel), log-softmax in float32. The
distance: the largest |difference| of a text token's logprob (nats), and the mean, over --texts passages.
"""

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

from dense_engine.formats import default_model, gguf_import, load, vocab
from dense_engine.runtime import caches

PASSAGES = [
    ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step, and "
     "every step of it is taken by someone who chose to keep walking when the road turned steep."),
    ("In 1969, Neil Armstrong and Buzz Aldrin became the first people to walk on the Moon, while Michael Collins "
     "orbited above in the command module Columbia, waiting to carry them home."),
    ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
     "print([fibonacci(i) for i in range(10)])\n"),
    ("Photosynthesis converts light energy into chemical energy: chlorophyll absorbs red and blue light, water is "
     "split, oxygen is released, and carbon dioxide is fixed into sugars in the Calvin cycle."),
    ("Question: What is the capital of France?\nAnswer: The capital of France is Paris, a city on the Seine known for "
     "the Eiffel Tower, the Louvre and its cafes."),
    ("She opened the old letter slowly. The paper was yellow and brittle, and the ink had faded to the color of weak "
     "tea, but the words were still there, waiting for her after forty years."),
]


def engine_logprobs(model, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """[T - 1] logprobs of tokens 1..T-1, from a cached prefill from slot 0 (the server's echo)."""
    caches.setup_cache(model, 1, 2048, kv_dtype)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), input_pos=torch.arange(len(ids)))[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def reference_model(path: str):
    """transformers' model of a GGUF file, its blocks dequantized to float32 (as from_pretrained(gguf_file=) reads
    it, without accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    hf.load_state_dict({name: torch.as_tensor(t) for name, t in tensors.items()}, strict=False)  # (a tied head)
    hf.tie_weights()
    return hf.eval()


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def decode_ms(model, kv_dtype: str, position: int, steps: int = 64) -> float:
    """Median milliseconds of an eager decode step at `position` with this cache."""
    caches.setup_cache(model, 1, 4096, kv_dtype)
    times = []
    with torch.no_grad():
        model(torch.zeros(1, position, dtype=torch.long), input_pos=torch.arange(position))
        for p in range(position, position + steps):
            start = time.perf_counter()
            model(torch.zeros(1, 1, dtype=torch.long), input_pos=torch.tensor([p]))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", help="a GGUF file (default: the default model's)")
    p.add_argument("--texts", type=int, default=len(PASSAGES))
    p.add_argument("--kv-dtypes", default="bfloat16,float16,float32,int8")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        path = args.gguf or default_model.fetch_default_gguf(work)
        model = load.from_pretrained(path, quant="auto")
        hf = reference_model(path)
        tokenizer = vocab.gguf_tokenizer(gguf_import.open_gguf(path), path)
    texts = [tokenizer.encode(t).ids for t in PASSAGES[:args.texts]]
    print(f"# {os.path.basename(path)} (--quant auto), {platform.processor() or platform.machine()}")
    print(f"texts: {len(texts)}, tokens: {sum(len(t) for t in texts)}; torch threads {torch.get_num_threads()}")
    reference = [reference_logprobs(hf, ids) for ids in texts]
    print("| --kv-dtype | largest difference from transformers (nats) | mean | decode ms at 64 / 2,000 |")
    print("|---|---:|---:|---:|")
    for kv_dtype in args.kv_dtypes.split(","):
        try:
            diffs = torch.cat([(engine_logprobs(model, ids, kv_dtype) - ref).abs()
                               for ids, ref in zip(texts, reference)])
        except Exception as e:  # noqa: BLE001 (a cache this device does not offer: said in its row)
            print(f"| {kv_dtype} | {type(e).__name__}: {e} | | |")
            continue
        speed = f"{decode_ms(model, kv_dtype, 64):.2f} / {decode_ms(model, kv_dtype, 2000):.2f}"
        print(f"| {kv_dtype} | {float(diffs.max()):.2e} | {float(diffs.mean()):.2e} | {speed} |")


if __name__ == "__main__":
    main()
