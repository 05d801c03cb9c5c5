"""Fingerprints that tie a stored KV to the exact model weights, dtype and tokenizer."""

from __future__ import annotations

import hashlib
import json

import torch


def model_fingerprint(model) -> str:
    """Hash of the config, the compute dtype and a strided sample of every weight (fast, content-based)."""
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        # ~1k evenly spaced elements per tensor tell fine-tunes and random inits apart.
        sample = flat[:: max(1, flat.numel() // 1024)].to(device="cpu", dtype=torch.float32)
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary and special tokens."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:16]


def weights_fingerprint(model, tokenizer) -> str:
    """Like `model_fingerprint` + `tokenizer_fingerprint`, but the same whatever dtype the model runs in: what
    trained links are keyed by (trained in float32, they serve the bfloat16 run of the same weights too)."""
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        # rounded to bf16: a float32 model and its bfloat16 cast give the same sample
        sample = flat[:: max(1, flat.numel() // 1024)].to(device="cpu", dtype=torch.bfloat16).to(torch.float32)
        h.update(f"{name}:{tuple(param.shape)}".encode())
        h.update(sample.numpy().tobytes())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:16]
