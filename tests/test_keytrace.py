"""Key traces: every format reads back what was written; corrupt input names file and place."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from cachelab.errors import CachelabError
from cachelab.trace.keytrace import ORACLE_DTYPE, read_keys, read_oracle_general, sniff_format, write_oracle_general

KEYS = np.array([5, 0, 7, 5, 2**40, 7, 5], dtype=np.int64)


def test_formats_round_trip_and_are_sniffed(tmp_path):
    np.save(tmp_path / "k.npy", KEYS.astype(np.uint32 if KEYS.max() < 2**32 else np.int64))
    (tmp_path / "k.txt").write_text("\n".join(map(str, KEYS)) + "\n\n")
    (tmp_path / "k.txt.gz").write_bytes(gzip.compress(("\r\n".join(map(str, KEYS)) + "\r\n*\r\n").encode()))
    write_oracle_general(tmp_path / "k.bin", KEYS)
    for name, fmt in (("k.npy", "npy"), ("k.txt", "txt"), ("k.txt.gz", "txt"), ("k.bin", "oracle")):
        assert sniff_format(tmp_path / name) == fmt
        assert read_keys(tmp_path / name).tolist() == KEYS.tolist()


def test_oracle_general_next_field_is_one_based_next_request(tmp_path):
    rec = np.fromfile(write_oracle_general(tmp_path / "t.oracleGeneral", KEYS), dtype=ORACLE_DTYPE)
    assert rec["next"].tolist() == [4, -1, 6, 7, -1, -1, -1]
    assert rec["size"].tolist() == [1] * KEYS.size and rec["time"].tolist() == list(range(KEYS.size))


def test_real_cloudphysics_trace_reads(data_dir):
    keys = read_keys(data_dir / "cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.oracleGeneral.bin")
    assert keys.size == 113_872 and keys.min() >= 0


def test_corrupt_inputs_name_file_and_place(tmp_path):
    bad = tmp_path / "trunc.oracleGeneral"
    bad.write_bytes(write_oracle_general(tmp_path / "ok.bin", KEYS).read_bytes()[:-5])
    with pytest.raises(CachelabError, match=r"trunc.oracleGeneral: truncated oracleGeneral record 6"):
        read_oracle_general(bad)
    (tmp_path / "t.txt").write_text("1\n2\nthree\n4\n")
    with pytest.raises(CachelabError, match=r"t.txt, line 3: b'three' is not an integer key"):
        read_keys(tmp_path / "t.txt")
    (tmp_path / "big.txt").write_text("1\n" + str(2**70) + "\n")
    with pytest.raises(CachelabError, match=r"big.txt, line 2: key .* does not fit in int64"):
        read_keys(tmp_path / "big.txt")
    np.save(tmp_path / "f.npy", np.array([1.5]))
    with pytest.raises(CachelabError, match="f.npy: keys must be integers"):
        read_keys(tmp_path / "f.npy")
    with pytest.raises(CachelabError, match="trace not found"):
        read_keys(tmp_path / "missing.txt")
