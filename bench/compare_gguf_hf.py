"""Compare this engine with Hugging Face transformers on the same GGUF file (transformers is optional, not a
dependency of the project): float32 logits, a 64-token greedy continuation, and tokenizer ids on varied text.

    python bench/compare_gguf_hf.py [path/to/model.gguf]     # default: the SmolLM2-135M-Instruct default model
"""

import os
import sys

import torch

from dense_engine.formats import default_model, gguf_import, load, vocab
from dense_engine.runtime import generate

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was 1999, and 42 people cheered!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])",
    "Crème brûlée, naïve café, Ångström, señor, Straße — déjà vu.",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 🙂🚀👩‍💻 🇫🇷 and symbols ∑∫√ ≠ ≤",
    "runs   of    spaces\n\n\n\tand tabs\t\tand\r\nnewlines   \n  ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "",
]


def main(path: str) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ours = vocab.gguf_tokenizer(gguf_import.open_gguf(path), path)
    mismatches = 0
    for text in TEXTS:
        a, b = hf_tok(text, add_special_tokens=False)["input_ids"], ours.encode(text).ids
        if a != b:
            mismatches += 1
            print(f"tokenizer MISMATCH on {text[:30]!r}:\n  hf   {a}\n  ours {b}")
        assert ours.decode(b, skip_special_tokens=False) == text or text == "", text
    print(f"tokenizer: {len(TEXTS) - mismatches}/{len(TEXTS)} texts give identical ids")

    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model = load.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([ours.encode(TEXTS[0] + " " + TEXTS[1]).ids])
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = model(ids)
    rel = float((got - ref).abs().max() / ref.abs().max())
    print(f"float32 logits over {ids.shape[1]} tokens: max |diff| / max |ref| = {rel:.2e}")
    prompt = torch.tensor([ours.encode(TEXTS[6]).ids])
    ref_ids = prompt
    with torch.no_grad():  # plain greedy loop over the HF model (generate() would stop at or mask eos)
        for _ in range(64):
            ref_ids = torch.cat([ref_ids, hf(ref_ids).logits[:, -1:].argmax(-1)], dim=1)
    ref_tokens = ref_ids[0, prompt.shape[1]:]
    our_tokens = generate.generate(model, prompt, 64)[0, prompt.shape[1]:]
    same = int((ref_tokens == our_tokens).long().cumprod(0).sum())
    print(f"greedy continuation: {same}/64 tokens identical")
    print("continuation:", repr(ours.decode(our_tokens.tolist(), skip_special_tokens=False)))
    ok = mismatches == 0 and rel < 1e-4 and same == 64
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(sys.argv[1]))
    import tempfile


    sys.exit(main(default_model.fetch_default_gguf(tempfile.mkdtemp(prefix="dense-compare-"))))
