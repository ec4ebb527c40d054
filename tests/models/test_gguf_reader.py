"""wafer's GGUF header reader against gguf-py's GGUFReader, on the bundled file and a damaged one."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from wafer.models.gguf_reader import GGUFHeader
from wafer.models.loader import default_model_path


def test_header_matches_gguf_py():
    path = default_model_path()
    ours, ref = GGUFHeader(path), GGUFReader(str(path))
    assert ours.fields.keys() == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.fields[key]
        if isinstance(got, np.ndarray):
            got = got.tolist()
        assert got == want, key
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.data_offset, a.n_elements, a.n_bytes) == (b.tensor_type, b.data_offset,
                                                                              int(b.n_elements), int(b.n_bytes))
        assert a.shape == tuple(int(x) for x in b.shape)
    t = ours.tensors[5]
    assert np.array_equal(ours.data(t).reshape(-1), np.asarray(ref.tensors[5].data).view(np.uint8).reshape(-1))


def test_truncated_header_is_an_error(tmp_path):
    data = default_model_path().read_bytes()[:300_000]  # inside the vocabulary
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="truncated"):
        GGUFHeader(bad)
