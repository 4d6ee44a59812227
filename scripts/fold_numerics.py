#!/usr/bin/env python3
"""The folded layers' arithmetic (kernels/gemv_fold.cu) on a real checkpoint, on the CPU.

Folded one-token steps change a layer's sums: the norms' weights and consecutive projections
are multiplied together at load and rounded to bf16, and each norm's scale is applied after
the product. The GPU tests check them against the CPU backend on random weights; this checks
what they do to a real model's logits, in numpy, against transformers' f32 logits and greedy
text in the SmolLM2 parity fixture. Two forwards over each prompt, both rounding to bf16 where
the engine's kernels do:

- unfolded: the engine's five-launch layer (normed input, q/k/v, attention output, sublayer
  outputs and the activation rounded to bf16; the stream f32);
- folded: every layer's q/k/v after the first, and every gate/up, from the folded matrices,
  as `Forward::run_folded` computes them (for every position, which is stricter than the
  engine: its prompt steps are unfolded).

Usage (numpy only):

    python3 scripts/fold_numerics.py \
        --model ~/.cache/snapserve/models/SmolLM2-135M-Instruct-bf16 \
        --fixture engine/tests/fixtures/smollm2_parity.safetensors
"""

import argparse
import json
import struct
from pathlib import Path

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif t["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype=np.float32)
        elif t["dtype"] == "I64":
            arr = np.frombuffer(raw, dtype=np.int64)
        else:
            raise SystemExit(f"{name}: dtype {t['dtype']} not handled")
        out[name] = arr.reshape(t["shape"]).copy()
    return out


def bf16(x):
    """Round to the nearest bf16 (ties to even), kept in f32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).reshape(x.shape)


class Model:
    def __init__(self, folder):
        folder = Path(folder).expanduser()
        self.c = json.loads((folder / "config.json").read_text())
        self.w = read_safetensors(folder / "model.safetensors")
        c = self.c
        self.layers = c["num_hidden_layers"]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.hidden = c["hidden_size"]
        self.head_dim = self.hidden // self.heads
        self.eps = c["rms_norm_eps"]
        theta = c.get("rope_theta", 10000.0)
        d = self.head_dim
        self.inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)

    def p(self, layer, name):
        return self.w[f"model.layers.{layer}.{name}"]

    def qkv_weight(self, l):
        return np.concatenate(
            [self.p(l, f"self_attn.{x}_proj.weight") for x in "qkv"], axis=0
        )

    def gate_up_weight(self, l):
        return np.concatenate(
            [self.p(l, "mlp.gate_proj.weight"), self.p(l, "mlp.up_proj.weight")], axis=0
        )

    def scale(self, x):
        return 1.0 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + self.eps)

    def rope(self, x, positions):
        # x: [T, heads, D]; pairs (i, i + D/2).
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        half = self.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(np.float32)

    def attention(self, qkv):
        t = qkv.shape[0]
        d, hq, hk = self.head_dim, self.heads, self.kv_heads
        q = qkv[:, : hq * d].reshape(t, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d)
        v = qkv[:, (hq + hk) * d :].reshape(t, hk, d)
        pos = np.arange(t)
        q, k = bf16(self.rope(q, pos)), bf16(self.rope(k, pos))
        group = hq // hk
        out = np.zeros((t, hq, d), dtype=np.float32)
        mask = np.triu(np.full((t, t), -np.inf), 1)
        for h in range(hq):
            s = (q[:, h, :] @ k[:, h // group, :].T) / np.sqrt(d) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            out[:, h, :] = s @ v[:, h // group, :]
        return bf16(out.reshape(t, hq * d))

    def fold(self):
        """The folded matrices of `FoldedWeights::build`, rounded to bf16."""
        self.folded = []
        for l in range(self.layers):
            wo = self.p(l, "self_attn.o_proj.weight")
            g_ffn = self.p(l, "post_attention_layernorm.weight")
            gu = self.gate_up_weight(l) * g_ffn[None, :]
            rows = [np.concatenate([gu, gu @ wo], axis=1)]
            qkv_down = None
            if l + 1 < self.layers:
                g_attn = self.p(l + 1, "input_layernorm.weight")
                q = self.qkv_weight(l + 1) * g_attn[None, :]
                rows.append(np.concatenate([q, q @ wo], axis=1))
                qkv_down = bf16(q @ self.p(l, "mlp.down_proj.weight"))
            self.folded.append((bf16(np.concatenate(rows, axis=0)), qkv_down))

    def forward(self, ids, folded):
        x = self.embed[ids].astype(np.float32)
        f = self.c["intermediate_size"]
        normed = bf16(x * self.scale(x) * self.p(0, "input_layernorm.weight"))
        qkv = bf16(normed @ self.qkv_weight(0).T)
        for l in range(self.layers):
            a = self.attention(qkv)
            wo, wd = self.p(l, "self_attn.o_proj.weight"), self.p(l, "mlp.down_proj.weight")
            h = x
            x = h + bf16(a @ wo.T)
            if folded:
                gate_up_qkv, qkv_down = self.folded[l]
                raw = np.concatenate([h, a], axis=1) @ gate_up_qkv.T
                r = self.scale(x)
                gate, up = bf16(raw[:, :f] * r), bf16(raw[:, f : 2 * f] * r)
            else:
                n2 = bf16(x * self.scale(x) * self.p(l, "post_attention_layernorm.weight"))
                gu = n2 @ self.gate_up_weight(l).T
                gate, up = bf16(gu[:, :f]), bf16(gu[:, f:])
            s = bf16(gate / (1.0 + np.exp(-gate)) * up)
            x = x + bf16(s @ wd.T)
            if l + 1 == self.layers:
                break
            if folded:
                qkv = bf16((raw[:, 2 * f :] + s @ qkv_down.T) * self.scale(x))
            else:
                n1 = bf16(x * self.scale(x) * self.p(l + 1, "input_layernorm.weight"))
                qkv = bf16(n1 @ self.qkv_weight(l + 1).T)
        final = bf16(x * self.scale(x) * self.w["model.norm.weight"])
        return final @ self.lm_head.T


def rel_rms(want, got):
    return float(np.sqrt(((want - got) ** 2).mean() / (want**2).mean()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--greedy", type=int, default=24, help="greedy steps to compare")
    args = ap.parse_args()
    model = Model(args.model)
    model.fold()
    fx = read_safetensors(args.fixture)
    prompts = sorted({k.split("/")[1] for k in fx if k.startswith("prompt/")})
    print("prompt | rel RMS vs HF: unfolded, folded | folded vs unfolded | greedy equal to HF: unfolded, folded")
    for name in prompts:
        ids = fx[f"prompt/{name}/ids"]
        if len(ids) > 200:
            continue  # the long prompt: numpy's full-sequence attention takes too long
        positions = fx[f"prompt/{name}/positions"]
        want = fx[f"prompt/{name}/logits"]
        outs = {}
        for folded in (False, True):
            logits = model.forward(ids, folded)
            outs[folded] = logits[positions]
        greedy = {}
        for folded in (False, True):
            seq = list(ids)
            for _ in range(args.greedy):
                seq.append(int(np.argmax(model.forward(np.array(seq), folded)[-1])))
            greedy[folded] = seq[len(ids) :]
        hf = list(fx[f"prompt/{name}/greedy"][: args.greedy])
        same = {
            k: next((i for i, (a, b) in enumerate(zip(v, hf)) if a != b), len(hf))
            for k, v in greedy.items()
        }
        print(
            f"{name} | {rel_rms(want, outs[False]):.2e}, {rel_rms(want, outs[True]):.2e} | "
            f"{rel_rms(outs[False], outs[True]):.2e} | {same[False]}, {same[True]} of {len(hf)}"
        )


if __name__ == "__main__":
    main()
