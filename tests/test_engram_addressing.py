"""Bit-exactness of the addresser against ENGRAM.md's verified numbers."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab.engram import Addresser, compressed_map, encode, get_preset
from cachelab.engram.config import derive_multipliers, derive_primes, is_prime
from cachelab.engram.vocab import DEEPSEEK_V4_MAP_SHA256, bos_ids, map_sha256
from cachelab.errors import CachelabError

V41 = get_preset("deepseek-v4.1-flash")
SENTENCE = "Only Alexander the Great could tame the horse Bucephalus."


@pytest.fixture(scope="module")
def addresser():
    return Addresser(V41)


def test_compressed_map_size_checksum_and_vectors():
    cmap = compressed_map()
    assert cmap.size == 129_280
    assert int(cmap.max()) + 1 == 99_092
    assert map_sha256(cmap) == DEEPSEEK_V4_MAP_SHA256
    assert cmap[[0, 1, 2]].tolist() == [0, 1, 2]
    assert set(cmap[[671, 1805, 20852, 270]].tolist()) == {237}
    assert set(cmap[[46099, 42123, 27607]].tolist()) == {12850}
    assert set(cmap[[223, 262, 201]].tolist()) == {174}


@pytest.mark.parametrize("damage", ["meta", "npy"])
def test_a_cut_map_cache_is_rebuilt(tmp_path, monkeypatch, damage):
    """A cache file cut by a kill, or read while another process writes it, is rebuilt, not a crash."""
    from cachelab.engram import vocab

    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path))
    vocab.compressed_map.cache_clear()
    try:
        vocab.compressed_map()
        (cut,) = tmp_path.glob(f"compressed-map-*.{'json' if damage == 'meta' else 'npy'}")
        cut.write_bytes(cut.read_bytes()[:20])
        vocab.compressed_map.cache_clear()
        assert map_sha256(vocab.compressed_map()) == DEEPSEEK_V4_MAP_SHA256
        assert map_sha256(np.load(next(tmp_path.glob("compressed-map-*.npy")))) == DEEPSEEK_V4_MAP_SHA256
    finally:
        vocab.compressed_map.cache_clear()


def test_multipliers_rederived_from_pcg64():
    for name in ("deepseek-v4.1-flash", "engram-27b-demo"):
        cfg = get_preset(name)
        derived = derive_multipliers(cfg.layers, cfg.max_ngram, cfg.compressed_vocab)
        assert derived.tolist() == [list(m) for m in cfg.multipliers]
    assert V41.multiplier_array[0].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert V41.multiplier_array[1].tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_primes_offsets_and_table_totals():
    assert V41.table_rows.tolist() == [384_006_168, 384_016_682]
    assert V41.primes[0, [0, 7, 8, 23]].tolist() == [16000057, 16000183, 16000189, 16000463]
    assert V41.primes[1, [0, 23]].tolist() == [16000477, 16000889]
    assert V41.offsets[0, [1, 10, 23]].tolist() == [16000057, 160001276, 368005705]
    assert V41.offsets[1, [8, 23]].tolist() == [128004290, 368015793]
    assert len(set(V41.primes.ravel().tolist())) == V41.primes.size
    assert all(is_prime(int(p)) for p in V41.primes.ravel())
    demo = get_preset("engram-27b-demo")
    assert demo.table_rows.tolist() == [10_344_164, 10_348_242]
    assert derive_primes((1,), (100,), 3).tolist() == [[101, 103, 107]]


def test_worked_example_layer_1_and_14(addresser):
    ids = encode([SENTENCE], bos=True)[0]
    assert ids.tolist() == [0, 22898, 19737, 270, 9327, 1494, 112253, 270, 15000, 406, 11999, 25670, 349, 16]
    assert addresser.compress(ids).tolist() == [0, 1134, 15695, 237, 2049, 1260, 85761, 237, 12071, 36,
                                                9745, 20232, 290, 16]
    rows = addresser.rows(ids)
    assert rows.shape == (14, 2, 24) and rows.dtype == np.int32
    assert rows[3, 0].tolist() == [
        11058590, 21303656, 36798146, 48859067, 75302385, 89544038, 104682525, 126901866,
        128556708, 150294494, 164060325, 189614394, 193619639, 219849501, 227477252, 253201106,
        261433707, 276632747, 288172860, 318000218, 332572665, 346462640, 365975252, 377171107]
    assert rows[0, 0, [0, 8, 16]].tolist() == [5702652, 131476717, 257520185]
    assert rows[3, 1, [0, 8, 16]].tolist() == [586479, 128921301, 271502518]


def test_modulo_is_exact_at_extremes(addresser):
    """The reciprocal-multiply modulo equals Python's % on the largest mixes."""
    from cachelab.engram.addresser import _address_chunks

    cfg = V41
    # Multiplier 1 on the current token only, so the mix is the (huge) id itself.
    mults = np.array([[1, 0, 0, 0]], dtype=np.int64)
    cids = np.array([2**63 - 1, 2**62 + 7, 16000057 * 3, 0], dtype=np.int64)
    out = np.empty((4, 1, 24), np.int32)
    hist = np.full((1, 3), -1, np.int64)
    primes = cfg.primes[:1]
    offs = np.zeros_like(primes)
    _address_chunks(cids, np.zeros(4, bool), np.array([0, 4]), np.array([0]), hist, mults, primes,
                    1.0 / primes.astype(np.float64), offs, np.int64(0), out)
    for t, c in enumerate(cids.tolist()):
        assert out[t, 0].tolist() == [c % int(p) for p in primes[0]]


def test_dead_positions_latch(addresser):
    ids = encode(["the quick brown fox jumps over"], bos=False)[0]
    dead = np.zeros(ids.size, bool)
    dead[2] = True
    rows = addresser.rows(ids, dead=dead)
    plain = addresser.rows(ids)
    assert (rows[:2] == plain[:2]).all()
    # Position 2 is DEAD: all of its look-back is padded, like an empty sequence start.
    assert (rows[2] == addresser.rows(np.array([2]))[0]).all()
    # Position 3 looks back onto the DEAD token: the latch pads every order, like a restart.
    assert (rows[3] == addresser.rows(ids[3:4])[0]).all()
    # Beyond N-1 positions the DEAD token no longer reaches the look-back.
    assert (rows[6:] == plain[6:]).all()


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 129_279), min_size=0, max_size=40), min_size=1, max_size=5),
    cuts=st.lists(st.integers(1, 7), min_size=1, max_size=10),
)
def test_streaming_equals_prefill(addresser, seqs, cuts):
    flat = np.array([t for s in seqs for t in s], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    whole = addresser.rows(flat, offsets)
    stream = addresser.stream(len(seqs))
    pieces = {i: [] for i in range(len(seqs))}
    pos = [0] * len(seqs)
    step = 0
    while any(pos[i] < len(seqs[i]) for i in range(len(seqs))):
        active = [i for i in range(len(seqs)) if pos[i] < len(seqs[i])]
        chunk = [seqs[i][pos[i]:pos[i] + cuts[step % len(cuts)]] for i in active]
        out = stream.feed(np.array([t for c in chunk for t in c], dtype=np.int64),
                          np.concatenate([[0], np.cumsum([len(c) for c in chunk])]), seq=active)
        cursor = 0
        for i, c in zip(active, chunk):
            pieces[i].append(out[cursor:cursor + len(c)])
            cursor += len(c)
            pos[i] += len(c)
        step += 1
    for i in range(len(seqs)):
        got = np.concatenate(pieces[i]) if pieces[i] else whole[:0]
        assert (got == whole[offsets[i]:offsets[i + 1]]).all()


def test_rows_stay_inside_their_head_slice(addresser):
    rng = np.random.default_rng(1)
    rows = addresser.rows(rng.integers(0, 129_280, 5000))
    lo = V41.offsets[None, :, :]
    assert (rows >= lo).all() and (rows < lo + V41.primes[None]).all()


def _reference_rows(addresser, ids):
    """ENGRAM.md §3.6 in Python integers, one position at a time."""
    cfg = addresser.config
    cids = addresser.compress(ids).tolist()
    pad = int(addresser.pad)
    out = np.empty((len(cids), len(cfg.layers), cfg.columns), np.int64)
    for t in range(len(cids)):
        tau = [cids[t - k] if t - k >= 0 else pad for k in range(cfg.max_ngram)]
        for li in range(len(cfg.layers)):
            mults = cfg.multiplier_array[li].tolist()
            acc = tau[0] * mults[0]
            for k in range(1, cfg.max_ngram):
                acc ^= tau[k] * mults[k]
                for h in range(cfg.heads):
                    j = (k - 1) * cfg.heads + h
                    out[t, li, j] = int(cfg.offsets[li, j]) + acc % int(cfg.primes[li, j])
    return out


@settings(max_examples=25, deadline=None)
@given(base=st.integers(1, 1 << 20), ids=st.lists(st.integers(0, 129_279), min_size=1, max_size=12))
def test_rows_equal_the_reference_for_any_table_size(base, ids):
    """A small table (a custom layout's) is addressed exactly too: its prime is far below
    the range where the reciprocal-multiply quotient is off by at most one."""
    addresser = Addresser(V41.with_(name="tiny", base_sizes=(base, base + 1, 2 * base)))
    assert (addresser.rows(np.array(ids)) == _reference_rows(addresser, ids)).all()


def test_bad_token_id_names_value(addresser):
    with pytest.raises(CachelabError, match="token id 129280 at position 1"):
        addresser.rows(np.array([5, 129_280]))
    with pytest.raises(CachelabError, match="token id -1"):
        addresser.rows(np.array([-1]))


def test_bad_token_id_is_named_as_given(addresser):
    """A uint64 id past 2^63 was named as the negative int64 a cast made of it (-1 for 2^64 - 1),
    a value the caller's data does not hold; a 2-D compress with a bad id raised a TypeError."""
    with pytest.raises(CachelabError, match="token id 18446744073709551615 at position 1 "):
        addresser.rows(np.array([5, 2**64 - 1], np.uint64))
    with pytest.raises(CachelabError, match=r"token id 129280 at position \(1, 0\) "):
        addresser.compress(np.array([[5], [129_280]]))
    assert addresser.compress(np.array([3, 129_279], np.uint64)).tolist() == addresser.compress([3, 129_279]).tolist()


@pytest.mark.parametrize("ids", [np.zeros((2, 3), np.int64), np.int64(5)])
def test_token_ids_not_flat_are_refused_by_shape(addresser, ids):
    """A [batch, seq] array (the demo's shape) or a scalar: a clear error, where a 2-D array
    reached the compiled kernel and failed there with a Numba typing error."""
    with pytest.raises(CachelabError, match=r"token ids must be one flat array .* got shape " + re.escape(str(np.shape(ids)))):
        addresser.rows(ids)
    with pytest.raises(CachelabError, match="token ids must be one flat array"):
        addresser.stream(2).feed(ids)


def test_fractional_offsets_and_seq_are_refused_not_truncated(addresser):
    """offsets [0, 1.7, 3] were cast to [0, 1, 3] (the boundary moved, no error) and seq [0.5]
    to [0] (the chunk fed to another sequence); whole floats, as np.cumsum([]) gives, still do."""
    ids = np.array([5, 6, 7])
    with pytest.raises(CachelabError, match="offsets must be whole numbers, got 1.7"):
        addresser.rows(ids, offsets=[0, 1.7, 3])
    with pytest.raises(CachelabError, match="offsets must be whole numbers, got nan"):
        addresser.rows(ids, offsets=[0, np.nan, 3])
    with pytest.raises(CachelabError, match="seq must be whole numbers, got 1.5"):
        addresser.stream(3).feed(ids, seq=[1.5])
    with pytest.raises(CachelabError, match="offsets must be integers, got dtype <U1"):
        addresser.rows(ids, offsets=["0", "3"])
    assert (addresser.rows(ids, offsets=[0.0, 1.0, 3.0]) == addresser.rows(ids, offsets=[0, 1, 3])).all()
    assert addresser.rows(np.zeros(0, np.int64), offsets=np.concatenate([[0], np.cumsum([])])).shape == (0, 2, 24)


def test_reset_of_a_sequence_outside_the_stream_is_refused(addresser):
    """reset(-1) restarted the last sequence (NumPy's negative index): its next token was hashed
    as a sequence start, with no error."""
    stream = addresser.stream(2)
    stream.feed(np.array([5, 6, 7, 8, 9]), [0, 2, 5])
    for bad in (-1, 2, 1.0):
        with pytest.raises(CachelabError, match=rf"seq {bad} is not a sequence index in \[0, 2\)"):
            stream.reset(bad)
    assert (stream.feed(np.array([10]), seq=[1]) == addresser.rows(np.array([7, 8, 9, 10]))[-1:]).all()
    stream.reset(np.int64(1))
    assert (stream.feed(np.array([10]), seq=[1]) == addresser.rows(np.array([10]))).all()


def test_text_the_tokenizer_cannot_take_is_named():
    """A lone surrogate (json.loads('"\\ud83d"'), half an emoji) or a non-string was tokenizers'
    TypeError 'TextEncodeInput must be Union[...]', naming neither the text nor the character."""
    with pytest.raises(CachelabError, match=r"text 1 holds '\\ud83d' at character 3: a lone surrogate"):
        encode(["fine", "ok " + json.loads('"\\ud83d"') + " more"])
    with pytest.raises(CachelabError, match="text 0 is a bytes, not a string to tokenize"):
        encode([b"raw"])
    assert encode(["ok \U0001f600"])[0].size  # a whole pair is text


def test_bad_preset_and_tokenizer(tmp_path):
    with pytest.raises(CachelabError, match="unknown preset 'nope'"):
        get_preset("nope")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    from cachelab.engram.vocab import load_tokenizer

    with pytest.raises(CachelabError, match="is not a HF tokenizer.json"):
        load_tokenizer(str(bad))


def test_custom_layout_from_toml(tmp_path):
    spec = tmp_path / "tiny.toml"
    spec.write_text('layers = [3]\nmax_ngram = 3\nheads = 2\nbase_sizes = [1000, 2000]\nrow_dim = 64\nrow_dtype = "bf16"\n')
    cfg = get_preset(str(spec))
    assert cfg.compressed_vocab == 99_092 and cfg.row_bytes == 128
    assert cfg.primes.tolist() == [[1009, 1013, 2003, 2011]]
    rows = Addresser(cfg).rows(np.array([0, 5, 9, 9]))
    assert rows.shape == (4, 1, 4)
    spec.write_text("layers = [1]\nbogus = 3\n")
    with pytest.raises(CachelabError, match="bogus"):
        get_preset(str(spec))


@pytest.mark.parametrize("extra, message", [
    # one multiplier list for two layers: the kernel read the second layer's past the array
    ("multipliers = [[3, 5, 7]]", r"multipliers needs one list of max_ngram = 3 per layer of \[1, 2\]"),
    ("multipliers = [[3, 5], [7, 9]]", r"multipliers needs one list of max_ngram = 3"),
    ("multipliers = [[3, 5, 7], [9, 11, 93078876567784]]", r"multipliers: 93078876567784 is not an integer between"),
    ("multipliers = [1, 2]", "multipliers must be a list, got 1"),
    ("row_dim = 40", "row_dim 40 is not a multiple of 32"),
    ('heads = "2"', "heads: '2' is not an integer between 1 and 65536"),
    ("pad_id = -1", "pad_id: -1 is not an integer >= 0"),
    ('tokenizer = 5', "tokenizer must be 'deepseek-v4' or a path, got 5"),
    ("layers = 5", "layers must be a list, got 5"),
    ("base_sizes = [10.5, 2000]", "base_sizes: 10.5 is not an integer between 1 and 1099511627776"),
    # a list where a string belongs: a TypeError's words (unhashable type: 'list'), or taken as given
    ('row_dtype = ["bf16"]', r"row_dtype: \['bf16'\] is not a string"),
    ("name = 5", "name: 5 is not a string"),
    # past what int64 holds: an OverflowError traceback, a NumPy ValueError
    ("base_sizes = [9223372036854775807, 5]", "base_sizes: 9223372036854775807 is not an integer between 1 and 1099511627776"),
    ("heads = 1180591620717411303424", "heads: 1180591620717411303424 is not an integer between 1 and 65536"),
    ("note = [1]", r"note: \[1\] is not a string"),
])
def test_bad_layout_file_names_the_file_field_and_value(tmp_path, extra, message):
    spec = tmp_path / "bad.toml"
    lines = {"layers": "[1, 2]", "max_ngram": "3", "heads": "2", "base_sizes": "[1000, 2000]", "compressed_vocab": "99092"}
    key = extra.split(" = ")[0]
    lines[key] = extra.split(" = ", 1)[1]
    spec.write_text("".join(f"{k} = {v}\n" for k, v in lines.items()))
    with pytest.raises(CachelabError, match=rf"^{spec}: {message}"):
        get_preset(str(spec))


@pytest.mark.data
def test_bos_is_the_tokenizers_own(data_dir, tmp_path):
    """``encode(bos=True)`` put id 0 first whatever the tokenizer: DeepSeek's BOS, but Llama's
    ``!`` in the R1 distill (whose BOS is 128000), and a token Qwen2.5 never starts a prompt with.
    It is the ``bos_token`` of the tokenizer_config.json beside the tokenizer.json."""
    import shutil
    import zipfile

    assert bos_ids() == (0,) and encode(["hi"], bos=True)[0][0] == 0
    assert bos_ids(str(data_dir / "tokenizers" / "deepseek-v3" / "tokenizer.json")) == (0,)
    for name, bos in (("deepseek-r1-distill-llama-8b", (128000,)), ("qwen-2.5", ())):
        folder = tmp_path / name
        zipfile.ZipFile(data_dir / "tokenizers" / name / "tokenizer.json.zip").extractall(folder)
        shutil.copy(data_dir / "tokenizers" / name / "tokenizer_config.json", folder)
        path = str(folder / "tokenizer.json")
        assert bos_ids(path) == bos
        assert encode(["hi"], path, bos=True)[0].tolist() == [*bos, *encode(["hi"], path)[0].tolist()]
    (folder / "tokenizer_config.json").unlink()
    bos_ids.cache_clear()
    with pytest.raises(CachelabError, match="no tokenizer_config.json beside it to name its BOS token"):
        encode(["hi"], str(folder / "tokenizer.json"), bos=True)
    assert encode(["hi"], str(folder / "tokenizer.json"))[0].size  # no BOS asked: no config needed


def test_other_tokenizer_by_path(data_dir):
    """Any HF tokenizer.json is accepted: the DeepSeek-V3 one shares V4's BPE."""
    path = data_dir / "tokenizers" / "deepseek-v3" / "tokenizer.json"
    cmap = compressed_map(str(path))
    assert cmap.size == 128_815
    assert 90_000 < int(cmap.max()) + 1 < cmap.size


def test_a_layout_file_reads_its_tokenizer_from_its_own_folder(tmp_path, monkeypatch):
    """A relative ``tokenizer`` was read from the working directory: the same layout file named
    another tokenizer, or none, depending on where the command ran."""
    import shutil

    from cachelab.engram.vocab import tokenizer_path

    folder = tmp_path / "layouts"
    (folder / "tok").mkdir(parents=True)
    shutil.copy(tokenizer_path("deepseek-v4"), folder / "tok" / "tokenizer.json")
    spec = folder / "mine.toml"
    spec.write_text('tokenizer = "tok/tokenizer.json"\nlayers = [1]\nmax_ngram = 2\nheads = 2\n'
                    "base_sizes = [1000]\ncompressed_vocab = 99092\n")
    monkeypatch.chdir(tmp_path)  # not the layout's folder: tok/tokenizer.json is not here
    cfg = get_preset("layouts/mine.toml")
    assert cfg.tokenizer == str(folder / "tok" / "tokenizer.json")
    assert tokenizer_path(cfg.tokenizer).is_file()
