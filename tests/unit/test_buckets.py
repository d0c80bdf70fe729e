"""Bucket layout, packing and metadata of the weight sync (in-process, no group)."""

import pytest
import torch

from asyncrl.sync.buckets import ALIGN, BucketLayout, model_param_metas, pack, plan_buckets, unpack


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(100, generator=g).to(torch.bfloat16),
        "big": torch.randn(64, 64, generator=g),  # 16 KiB
        "c": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
    }


def _roundtrip(tensors, bucket_bytes):
    layout = plan_buckets([(n, t.dtype, t.shape) for n, t in tensors.items()], bucket_bytes)
    got = {}
    buf = torch.empty(layout.max_bucket_bytes, dtype=torch.uint8)
    for bucket in layout.buckets:
        packed = pack(bucket, [tensors[s.name] for s in bucket.slots], buf)
        assert packed.numel() == bucket.nbytes
        for name, view in unpack(bucket, packed):
            got[name] = view.clone()
    return layout, got


@pytest.mark.parametrize("bucket_bytes", [256, 4096, 10**7])
def test_every_tensor_roundtrips_bitwise(bucket_bytes):
    tensors = _tensors()
    layout, got = _roundtrip(tensors, bucket_bytes)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert torch.equal(got[name].view(torch.uint8) if t.dim() else got[name], t.view(torch.uint8) if t.dim() else t)
    assert layout.names == list(tensors)


def test_bucket_smaller_than_largest_tensor_gives_it_a_bucket_of_its_own():
    tensors = _tensors()
    layout, _ = _roundtrip(tensors, bucket_bytes=1024)
    big = [b for b in layout.buckets if any(s.name == "big" for s in b.slots)]
    assert len(big) == 1 and [s.name for s in big[0].slots] == ["big"]
    assert big[0].nbytes == 64 * 64 * 4 == layout.max_bucket_bytes
    for b in layout.buckets:
        assert b.nbytes <= 1024 or len(b.slots) == 1


def test_bucket_larger_than_model_is_one_bucket_with_aligned_offsets():
    tensors = _tensors()
    layout, _ = _roundtrip(tensors, bucket_bytes=10**7)
    assert len(layout.buckets) == 1
    slots = layout.buckets[0].slots
    assert all(s.offset % ALIGN == 0 for s in slots)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(slots, slots[1:]))
    assert layout.total_bytes == slots[-1].offset + slots[-1].nbytes


def test_layout_encodes_without_pickle_and_decodes_equal():
    layout = plan_buckets([("w", torch.float32, (2, 3)), ("v", torch.float16, (4,))], 16, aliases=[("x", "w")])
    data = layout.encode()
    assert b"\x80\x04" not in data[:2]  # not a pickle stream
    back = BucketLayout.decode(data)
    assert back == layout
    assert back.fingerprint() == layout.fingerprint()
    other = plan_buckets([("w", torch.float32, (2, 4)), ("v", torch.float16, (4,))], 16, aliases=[("x", "w")])
    assert other.fingerprint() != layout.fingerprint()


def test_decode_rejects_garbage_and_unknown_dtype():
    with pytest.raises(ValueError, match="not a valid layout"):
        BucketLayout.decode(b"\x00garbage")
    with pytest.raises(ValueError, match="unknown dtype 'floatXX'"):
        plan_buckets([("w", "floatXX", (2,))], 64)
    newer = plan_buckets([("w", "float32", (2,))], 64).encode().replace(b"\xa6format\x01", b"\xa6format\x02")
    with pytest.raises(ValueError, match="format 2"):
        BucketLayout.decode(newer)


def test_duplicate_names_and_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([("w", torch.float32, (2,)), ("w", torch.float32, (2,))], 64)
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("w", torch.float32, (2,))], 0)
    layout = plan_buckets([("w", torch.float32, (2,))], 64)
    with pytest.raises(ValueError, match=r"w: expected float32\[2\], got float32\[3\]"):
        pack(layout.buckets[0], [torch.zeros(3)], torch.empty(64, dtype=torch.uint8))


def test_tied_weights_are_listed_once_with_an_alias(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    metas, aliases = model_param_metas(model)
    names = [m[0] for m in metas]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert aliases == [("lm_head.weight", "model.embed_tokens.weight")]
    layout = plan_buckets(metas, 4096, aliases)
    assert layout.total_bytes >= sum(p.nbytes for p in model.parameters())
    assert layout.total_bytes < sum(p.nbytes for p in model.parameters()) + ALIGN * len(metas)
