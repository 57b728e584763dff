"""Every invalid argument of the fold and its raw op, of the read_bytes contract, the sources
and the engine layouts raises a Python exception whose message starts with `kv-canary:` and
names what to change; none crashes, reads out of bounds (the sanitizer job runs this file) or
copies a pool. KvCanary's refusals are in tests/canary/test_canary_refusals.py, the digest's
in tests/digest/test_digest_refusals.py, verify_transfer's in tests/digest/test_digest_transfer.py."""

import re
import sys

import expecttest
import pytest
import torch
from helpers import DEVICES, RAW_OP_REFUSAL, best_cpu_path, refusal, refusal_lines, refusal_table_test, run_python
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_kvcanary as kc
from torch_kvcanary import layouts, ops

U8 = torch.zeros(4, 2, 64, dtype=torch.uint8)  # a good view: 4 pages of 2 slots of 64 bytes
ROWS = torch.zeros(8, 64, dtype=torch.uint8)
SLOTS = torch.tensor([0, 1])
GOOD = kc.view_source(U8, read_bytes=64)
op = torch.ops.kvcanary.fold.default


def _real(**changes) -> kc.RealKvSource:
    """A RealKvSource of ROWS (one 64-byte token a page, all of it read) but for `changes`."""
    return kc.RealKvSource(**{"tensor": ROWS, "page_size": 1, "num_bytes_per_token": 64, "read_bytes": 64, **changes})


# (name, call, exception, message start after "kv-canary: ")
CASES = [
    # the read_bytes contract
    (
        "clip: token not a multiple of 16",
        lambda: kc.clip_read_bytes(requested=16, num_bytes_per_token=24),
        ValueError,
        "num_bytes_per_token must be a positive multiple of 16",
    ),
    ("clip: negative", lambda: kc.clip_read_bytes(requested=-32, num_bytes_per_token=64), ValueError, "read_bytes must be non-negative"),
    (
        "clip: too large",
        lambda: kc.clip_read_bytes(requested=80, num_bytes_per_token=64),
        ValueError,
        "read_bytes must be <= num_bytes_per_token (64)",
    ),
    (
        "clip: unaligned",
        lambda: kc.clip_read_bytes(requested=20, num_bytes_per_token=64),
        ValueError,
        "read_bytes must be a multiple of 16",
    ),
    ("clip: float", lambda: kc.clip_read_bytes(requested=16.0, num_bytes_per_token=64), TypeError, "read_bytes must be an int"),
    (
        "clip: string token",
        lambda: kc.clip_read_bytes(requested=16, num_bytes_per_token="64"),
        TypeError,
        "num_bytes_per_token must be an int",
    ),
    ("mode: unknown", lambda: kc.resolve_read_bytes(5), ValueError, "mode must be a HashMode"),
    # RealKvSource
    ("source: page_size 0", lambda: _real(page_size=0), ValueError, "RealKvSource.page_size must be >= 1"),
    ("source: page_size float", lambda: _real(page_size=1.5), TypeError, "RealKvSource.page_size must be an int"),
    (
        "source: token 40",
        lambda: _real(num_bytes_per_token=40, read_bytes=16),
        ValueError,
        "RealKvSource.num_bytes_per_token must be a positive multiple of 16",
    ),
    ("source: read 0", lambda: _real(read_bytes=0), ValueError, "RealKvSource.read_bytes must be a positive multiple of 16"),
    ("source: 1-D", lambda: _real(tensor=ROWS[0]), ValueError, "RealKvSource.tensor must be at least 2-D"),
    ("source: not a tensor", lambda: _real(tensor=[1, 2]), TypeError, "RealKvSource.tensor must be a torch.Tensor"),
    ("source: sparse", lambda: _real(tensor=ROWS.to_sparse()), ValueError, "RealKvSource.tensor must be a strided (dense) tensor"),
    ("source: page larger than row", lambda: _real(page_size=2), ValueError, "RealKvSource page of 2 x 64 bytes does not fit"),
    (
        "source: rows need a copy",
        lambda: kc.fold(
            kc.RealKvSource(tensor=torch.zeros(4, 4, 24, dtype=torch.uint8)[:, :, :16], page_size=2, num_bytes_per_token=32, read_bytes=16),
            SLOTS,
        ),
        ValueError,
        "RealKvSource.tensor with shape (4, 4, 16)",
    ),
    # helpers
    (
        "row source: not a tensor",
        lambda: kc.make_row_source(layer_buffer=None, read_bytes=16),
        TypeError,
        "layer_buffer must be a torch.Tensor",
    ),
    (
        "row source: token 12 bytes",
        lambda: kc.make_row_source(layer_buffer=torch.zeros(4, 3), read_bytes=16),
        ValueError,
        "num_bytes_per_token must be a positive multiple of 16, got 12",
    ),
    (
        "packed source: not a tensor",
        lambda: kc.make_packed_source(page_buffer=3, page_size=1, bytes_per_token=16, read_bytes=16),
        TypeError,
        "page_buffer must be a torch.Tensor",
    ),
    (
        "packed source: page too big",
        lambda: kc.make_packed_source(page_buffer=ROWS, page_size=4, bytes_per_token=32, read_bytes=16),
        ValueError,
        "RealKvSource page of 4 x 32 bytes does not fit",
    ),
    (
        "view source: rank 1",
        lambda: kc.view_source(torch.zeros(64, dtype=torch.uint8), read_bytes=16),
        ValueError,
        "view_source needs a view [num_pages, page_size, *token_shape]",
    ),
    (
        "view source: token 8 bytes",
        lambda: kc.view_source(torch.zeros(4, 2, 8, dtype=torch.uint8), read_bytes=16),
        ValueError,
        "num_bytes_per_token must be a positive multiple of 16, got 8",
    ),
    (
        "layouts: vllm without layout",
        lambda: layouts.vllm(torch.zeros(2, 4, 16, 2, 64)),
        ValueError,
        "layouts.vllm needs layout=",
    ),
    (
        "layouts: trtllm halves",
        lambda: layouts.trtllm_block_pool(torch.zeros(4, 3, 2, 16, 8)),
        ValueError,
        "a block pool is [num_blocks, 2, heads, tokens_per_block, head_dim]",
    ),
    # fold
    ("fold: mode", lambda: kc.fold(GOOD, SLOTS, mode=-1), ValueError, "mode must be a HashMode"),
    ("fold: mode bool", lambda: kc.fold(GOOD, SLOTS, mode=True), ValueError, "mode must be a HashMode"),
    ("fold: source type", lambda: kc.fold([GOOD, "K"], SLOTS), TypeError, "sources must be RealKvSource or ViewSource objects"),
    ("fold: slots list", lambda: kc.fold(GOOD, [0, 1]), TypeError, "slots must be an int32 or int64 tensor, got list"),
    ("fold: slots float", lambda: kc.fold(GOOD, SLOTS.float()), TypeError, "slots must be an int32 or int64 tensor, got Float"),
    ("fold: slots bool", lambda: kc.fold(GOOD, SLOTS.bool()), TypeError, "slots must be an int32 or int64 tensor, got Bool"),
    ("fold: slots uint8", lambda: kc.fold(GOOD, SLOTS.to(torch.uint8)), TypeError, "slots must be an int32 or int64 tensor, got Byte"),
    ("fold: slot = capacity", lambda: kc.fold(GOOD, torch.tensor([8])), IndexError, "slot 8 is out of range for sources of capacity 8"),
    ("fold: huge slot", lambda: kc.fold(GOOD, torch.tensor([0, 2**62])), IndexError, f"slot {2**62} is out of range"),
    ("fold: int32 slot", lambda: kc.fold(GOOD, torch.tensor([9], dtype=torch.int32)), IndexError, "slot 9 is out of range"),
    (
        "fold: innermost stride",
        lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 16, 2)[..., 0], read_bytes=16), SLOTS),
        ValueError,
        "source 0 must have a contiguous innermost dim",
    ),
    (
        "fold: expanded innermost",
        lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 1, dtype=torch.uint8).expand(4, 2, 16), read_bytes=16), SLOTS),
        ValueError,
        "source 0 must have a contiguous innermost dim",
    ),
    (
        "fold: short runs",
        lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 4, 16, dtype=torch.uint8)[..., :8], read_bytes=16), SLOTS),
        ValueError,
        "source 0 has contiguous runs of 8 bytes",
    ),
    (
        "fold: slot stride",
        lambda: kc.fold(kc.view_source(torch.zeros(4, 2, 24, dtype=torch.uint8)[..., :16], read_bytes=16), SLOTS),
        ValueError,
        "source 0 has a stride of 24 bytes",
    ),
    (
        "fold: misaligned",
        lambda: kc.fold(kc.view_source(torch.zeros(600, dtype=torch.uint8)[4:516].view(4, 2, 64), read_bytes=16), SLOTS),
        ValueError,
        "source 0 starts at an address that is not 16-byte aligned",
    ),
    (
        "fold: devices",
        lambda: kc.fold(kc.view_source(U8.to("meta"), read_bytes=16), SLOTS),
        ValueError,
        "source 0 is on meta but slots are on cpu",
    ),
    # the raw op
    ("op: list lengths", lambda: op([U8, U8], SLOTS, [16], True), RAW_OP_REFUSAL, "got 2 sources but 1 read_bytes"),
    ("op: read 0", lambda: op([U8], SLOTS, [0], True), RAW_OP_REFUSAL, "read_bytes[0] must be a positive multiple of 16"),
    ("op: read negative", lambda: op([U8], SLOTS, [-16], True), RAW_OP_REFUSAL, "read_bytes[0] must be a positive multiple of 16"),
    (
        "op: read past token",
        lambda: op([U8], SLOTS, [80], True),
        RAW_OP_REFUSAL,
        "read_bytes[0] must be a positive multiple of 16 and <= the source's 64 bytes",
    ),
    (
        "op: rank 1",
        lambda: op([U8.view(-1)], SLOTS, [16], True),
        RAW_OP_REFUSAL,
        "source 0 must be a view [num_pages, page_size, *token_shape]",
    ),
    (
        "op: empty token",
        lambda: op([torch.zeros(4, 2, 0, dtype=torch.uint8)], SLOTS, [16], True),
        RAW_OP_REFUSAL,
        "source 0 has 0 bytes per token",
    ),
    ("op: slots dtype", lambda: op([U8], SLOTS.short(), [16], True), RAW_OP_REFUSAL, "slots must be an int32 or int64 tensor"),
    ("op: second source bad", lambda: op([U8, U8[:, :, :8]], SLOTS, [16, 16], True), RAW_OP_REFUSAL, "source 1 has 8 bytes per token"),
    (
        "op: slot out of range",
        lambda: op([U8], torch.tensor([[0, 9]]), [16], True),
        IndexError,
        "slot 9 is out of range for sources of capacity 8",
    ),
]


test_bad_input = refusal_table_test(CASES)


def test_no_copy_of_the_pool():
    # The op reads the caller's memory: a write after building the sources shows up.
    pool = torch.zeros(16, 2, 4, 32, dtype=torch.bfloat16)
    source = kc.view_source(pool.permute(0, 2, 1, 3)[:, :, :, :16], read_bytes=sys.maxsize)
    before = kc.fold(source, torch.arange(64))
    pool[3, 1, 2, 5] = 1.0
    after = kc.fold(source, torch.arange(64))
    assert (before != after).nonzero().flatten().tolist() == [3 * 4 + 2]


def test_forced_cpu_path_the_cpu_lacks():
    # A process reads KVCANARY_CPU_ISA when a kernel first runs, so a child forces the path.
    fold = "kc.fold(kc.view_source(torch.zeros(4, 2, 64, dtype=torch.uint8), read_bytes=64), torch.tensor([0, 1]))"
    code = f"import torch, torch_kvcanary as kc\ntry:\n    {fold}\nexcept ValueError as error:\n    print(error)"
    child = run_python(["-c", code], KVCANARY_CPU_ISA="sse9")
    assert child.returncode == 0, child.stderr
    message = f"kv-canary: KVCANARY_CPU_ISA=sse9 is not a path this CPU can run; use one of scalar..{best_cpu_path()} or unset it"
    assert child.stdout.splitlines() == [message]


@pytest.mark.parametrize(
    "slots, exception",
    [(SLOTS, ValueError), (SLOTS.float(), TypeError)],
    ids=["a value refused", "a dtype refused"],
)
def test_a_refusal_raised_as_runtime_error_reaches_the_caller_as_documented(monkeypatch, slots, exception):
    # From torch 2.15 on, torch raises a kernel's std::invalid_argument as RuntimeError
    # (csrc/plan/checks.h); the package's functions raise the types they document.
    message = "kv-canary: source 0 has 8 bytes per token; it must be a positive multiple of 16"

    def refusing_op(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(torch.ops.kvcanary, "fold", refusing_op)
    with pytest.raises(exception) as info:
        kc.fold(GOOD, slots)
    assert type(info.value) is exception
    expected = message if exception is ValueError else "kv-canary: slots must be an int32 or int64 tensor, got Float"
    assert str(info.value) == expected


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access"),
        IndexError("kv-canary: slot 9 is out of range"),
        kc.KvCorruptionError(["kv-canary: a subclass of RuntimeError"], []),
    ],
    ids=["not a refusal", "index error", "a RuntimeError subclass"],
)
def test_other_errors_of_an_op_pass_through_unchanged(error):
    assert ops.refusal(error, {"slots": SLOTS.float()}) is error


def test_a_torch_older_than_the_floor_is_refused_before_a_library_loads():
    # The libraries would fail to load there on a missing stable-ABI symbol; the package says why.
    code = (
        "import sys, torch\n"
        "torch.__version__ = '2.9.1+cu128'\n"
        "try:\n"
        "    import torch_kvcanary\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        "print(sorted(name for name in sys.modules if name.startswith('torch_kvcanary._C')))"
    )
    child = run_python(["-c", code])
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [
        "kv-canary: torch_kvcanary needs torch 2.10 or later, this is torch 2.9.1+cu128; install torch>=2.10",
        "[]",
    ]


# --- exact messages ------------------------------------------------------------------------


# The messages and their order are upstream's, written out here by hand.
@pytest.mark.parametrize(
    "requested, nb, message",
    [
        (16, 0, "kv-canary: num_bytes_per_token must be a positive multiple of 16, got 0"),
        (16, -16, "kv-canary: num_bytes_per_token must be a positive multiple of 16, got -16"),
        (0, 40, "kv-canary: num_bytes_per_token must be a positive multiple of 16, got 40"),
        (-16, 64, "kv-canary: read_bytes must be non-negative, got -16"),
        (-1, 64, "kv-canary: read_bytes must be non-negative, got -1"),
        (80, 64, "kv-canary: read_bytes must be <= num_bytes_per_token (64), got 80"),
        (81, 64, "kv-canary: read_bytes must be <= num_bytes_per_token (64), got 81"),
        (24, 64, "kv-canary: read_bytes must be a multiple of 16, got 24"),
        (1, 64, "kv-canary: read_bytes must be a multiple of 16, got 1"),
    ],
)
def test_clip_read_bytes_errors(requested, nb, message):
    with pytest.raises(ValueError) as info:
        kc.clip_read_bytes(requested=requested, num_bytes_per_token=nb)
    assert str(info.value) == message


class TestRealKvSourceMessages(expecttest.TestCase):
    def _error(self, **kwargs) -> str:
        args = dict(tensor=torch.zeros(4, 64, dtype=torch.uint8), page_size=1, num_bytes_per_token=64, read_bytes=64)
        args.update(kwargs)
        with self.assertRaises(ValueError) as info:
            kc.RealKvSource(**args)
        return str(info.exception)

    def test_messages(self):
        self.assertExpectedInline(self._error(page_size=0), """kv-canary: RealKvSource.page_size must be >= 1, got 0""")
        self.assertExpectedInline(
            self._error(num_bytes_per_token=40),
            """kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 40""",
        )
        self.assertExpectedInline(
            self._error(read_bytes=80),
            """kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=64], got 80""",
        )
        self.assertExpectedInline(
            self._error(read_bytes=0),
            """kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=64], got 0""",
        )
        self.assertExpectedInline(
            self._error(tensor=torch.zeros(64, dtype=torch.uint8)),
            """kv-canary: RealKvSource.tensor must be at least 2-D, got shape (64,)""",
        )
        self.assertExpectedInline(
            self._error(page_size=2),
            """kv-canary: RealKvSource page of 2 x 64 bytes does not fit in a row of 64 bytes (tensor shape (4, 64), dtype torch.uint8); lower page_size or num_bytes_per_token""",
        )

    def test_rows_that_need_a_copy_are_refused(self):
        # Rows (dims 1..) that are not one contiguous run cannot be windows of bytes.
        pool = torch.zeros(4, 8, 6, dtype=torch.uint8)[:, :, :4]
        source = kc.RealKvSource(tensor=pool, page_size=2, num_bytes_per_token=16, read_bytes=16)
        with self.assertRaises(ValueError) as info:
            source.as_view()
        self.assertExpectedInline(
            str(info.exception),
            """kv-canary: RealKvSource.tensor with shape (4, 8, 4) and strides (48, 6, 1) cannot be read as rows without a copy; make each row (dims 1..) contiguous, or describe the layout with view_source""",
        )


def _raw(views, slots, read_bytes):
    return lambda: torch.ops.kvcanary.fold(views, slots, read_bytes)


class TestFoldErrors(expecttest.TestCase):
    def test_slot_out_of_range(self):
        source = kc.view_source(torch.zeros(3, 4, 16, dtype=torch.uint8), read_bytes=16)
        self.assertExpectedInline(
            refusal(IndexError, lambda: kc.fold(source, torch.tensor([0, 12, 13]))),
            """kv-canary: slot 12 is out of range for sources of capacity 12; slots must be < 12 (or negative for padding)""",
        )
        # the smallest capacity counts
        small = kc.view_source(torch.zeros(1, 4, 16, dtype=torch.uint8), read_bytes=16)
        self.assertIn(
            "slot 4 is out of range for sources of capacity 4",
            refusal(IndexError, lambda: kc.fold([source, small], torch.tensor([4], dtype=torch.int32))),
        )
        self.assertIn(
            "kv-canary: slot 12 is out of range",
            refusal(IndexError, lambda: kc.reference_fold(source, torch.tensor([12]))),
        )

    def test_slots(self):
        source = kc.view_source(torch.zeros(3, 4, 16, dtype=torch.uint8), read_bytes=16)
        self.assertExpectedInline(
            refusal(TypeError, lambda: kc.fold(source, torch.tensor([0.0]))),
            """kv-canary: slots must be an int32 or int64 tensor, got Float""",
        )
        self.assertExpectedInline(
            refusal(TypeError, lambda: kc.fold(source, [0, 1])),
            """kv-canary: slots must be an int32 or int64 tensor, got list""",
        )
        self.assertExpectedInline(
            refusal(TypeError, lambda: kc.fold(source, torch.tensor([0], dtype=torch.int16))),
            """kv-canary: slots must be an int32 or int64 tensor, got Short""",
        )

    def test_mode_and_sources(self):
        source = kc.view_source(torch.zeros(3, 4, 16, dtype=torch.uint8), read_bytes=16)
        slots = torch.tensor([0])
        self.assertExpectedInline(
            refusal(ValueError, lambda: kc.fold(source, slots, mode=3)),
            """kv-canary: mode must be a HashMode (OFF=0, PARTIAL=1, ALL=2), got 3""",
        )
        self.assertExpectedInline(
            refusal(ValueError, lambda: kc.fold(source, slots, mode="ALL")),
            """kv-canary: mode must be a HashMode (OFF=0, PARTIAL=1, ALL=2), got 'ALL'""",
        )
        self.assertExpectedInline(
            refusal(TypeError, lambda: kc.fold([torch.zeros(3, 4, 16)], slots)),
            """kv-canary: sources must be RealKvSource or ViewSource objects (from make_row_source, make_packed_source or view_source), got Tensor""",
        )

    def test_layouts(self):
        u8 = torch.zeros(4, 2, 80, dtype=torch.uint8)
        slots = torch.tensor([0])
        cases = {
            "innermost not contiguous": kc.view_source(torch.zeros(4, 2, 32, 16)[..., 0], read_bytes=16),
            "run of 8 bytes": kc.view_source(torch.zeros(4, 2, 4, 16, dtype=torch.uint8)[..., :8], read_bytes=16),
            "page stride 40": kc.view_source(torch.zeros(4, 40, dtype=torch.uint8)[:, :32].view(4, 2, 16), read_bytes=16),
            "misaligned pointer": kc.view_source(u8.view(-1)[8 : 8 + 4 * 128].view(4, 2, 64), read_bytes=16),
            "row stride 100": kc.RealKvSource(
                tensor=torch.zeros(4, 100, dtype=torch.uint8)[:, :96], page_size=1, num_bytes_per_token=96, read_bytes=16
            ),
        }
        self.assertExpectedInline(
            refusal_lines(ValueError, {name: (lambda s=s: kc.fold(s, slots)) for name, s in cases.items()}),
            """\
innermost not contiguous: kv-canary: source 0 must have a contiguous innermost dim (stride 1), got shape [4, 2, 32] and strides [1024, 512, 16]; make the fastest-moving dim of each token the last one
run of 8 bytes: kv-canary: source 0 has contiguous runs of 8 bytes (shape [4, 2, 4, 8], strides [128, 64, 16, 1]); each contiguous innermost run must be a multiple of 16 bytes
page stride 40: kv-canary: source 0 has a stride of 40 bytes (shape [4, 2, 16], strides [40, 16, 1], dtype Byte); every stride must be a multiple of 16 bytes
misaligned pointer: kv-canary: source 0 starts at an address that is not 16-byte aligned (storage offset 8 elements of 1 bytes); pass a view whose first byte is 16-byte aligned
row stride 100: kv-canary: source 0 has a stride of 100 bytes (shape [4, 1, 96], strides [100, 96, 1], dtype Byte); every stride must be a multiple of 16 bytes""",
        )

    def test_raw_op_arguments(self):
        pool = torch.zeros(4, 2, 32, dtype=torch.uint8)
        slots = torch.tensor([0])
        cases = {
            "list lengths": _raw([pool, pool], slots, [16]),
            "read_bytes 24": _raw([pool], slots, [24]),
            "read_bytes 0": _raw([pool], slots, [0]),
            "read_bytes > token": _raw([pool], slots, [48]),
            "rank 1": _raw([pool.view(-1)], slots, [16]),
            "token of 8 bytes": _raw([torch.zeros(4, 2, 8, dtype=torch.uint8)], slots, [16]),
        }
        self.assertExpectedInline(
            refusal_lines(RAW_OP_REFUSAL, cases),
            """\
list lengths: kv-canary: got 2 sources but 1 read_bytes; pass one read_bytes per source
read_bytes 24: kv-canary: read_bytes[0] must be a positive multiple of 16 and <= the source's 32 bytes per token, got 24
read_bytes 0: kv-canary: read_bytes[0] must be a positive multiple of 16 and <= the source's 32 bytes per token, got 0
read_bytes > token: kv-canary: read_bytes[0] must be a positive multiple of 16 and <= the source's 32 bytes per token, got 48
rank 1: kv-canary: source 0 must be a view [num_pages, page_size, *token_shape], got shape [256]
token of 8 bytes: kv-canary: source 0 has 8 bytes per token (shape [4, 2, 8], dtype Byte); it must be a positive multiple of 16""",
        )

    def test_devices(self):
        pool = torch.zeros(4, 2, 32, dtype=torch.uint8, device="meta")
        self.assertExpectedInline(
            refusal(ValueError, _raw([pool], torch.tensor([0]), [16])),
            """kv-canary: source 0 is on meta but slots are on cpu; put them on one device""",
        )


# The fake kernel (FakeTensor, torch.compile) refuses what the kernels refuse without data,
# with their messages; being Python, it raises the types the package documents.
FAKE_CASES = [
    ("slots dtype", lambda u8, slots: op([u8], slots.short(), [16], True), TypeError),
    ("list lengths", lambda u8, slots: op([u8, u8], slots, [16], True), ValueError),
    ("rank 1", lambda u8, slots: op([u8.view(-1)], slots, [16], True), ValueError),
    ("second source rank 1", lambda u8, slots: op([u8, u8.view(-1)], slots, [16, 16], True), ValueError),
]


@pytest.mark.parametrize("name, call, exception", FAKE_CASES, ids=[c[0] for c in FAKE_CASES])
def test_fake_kernel_refuses_like_the_kernels(name, call, exception):
    with pytest.raises(RAW_OP_REFUSAL) as real:
        call(U8, SLOTS)
    with FakeTensorMode() as mode, pytest.raises(exception) as fake:
        call(mode.from_tensor(U8), mode.from_tensor(SLOTS))
    assert str(fake.value) == str(real.value)


# --- sources and engine layouts ---------------------------------------------------------------


def test_source_helpers_exact_messages():
    with pytest.raises(ValueError, match=r"^kv-canary: read_bytes must be <= num_bytes_per_token \(32\), got 48$"):
        kc.make_row_source(layer_buffer=torch.zeros(4, 8, dtype=torch.float32), read_bytes=48)
    with pytest.raises(ValueError, match=r"^kv-canary: num_bytes_per_token must be a positive multiple of 16, got 12$"):
        kc.make_row_source(layer_buffer=torch.zeros(4, 3, dtype=torch.float32), read_bytes=16)
    cache = torch.zeros(2, 4, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^kv-canary: read_bytes must be a multiple of 16, got 8$"):
        kc.view_source(cache, read_bytes=8)
    with pytest.raises(
        ValueError, match=r"^kv-canary: view_source needs a view \[num_pages, page_size, \*token_shape\], got shape \(4,\)$"
    ):
        kc.view_source(torch.zeros(4), read_bytes=16)


@pytest.mark.parametrize(
    "helper, shape",
    [(layouts.vllm_fused, (4, 3, 16, 8)), (layouts.trtllm_block_pool, (4, 3, 2, 16, 8))],
)
def test_layout_shape_errors(helper, shape):
    with pytest.raises(ValueError, match="^kv-canary: "):
        helper(torch.zeros(shape))
    with pytest.raises(ValueError, match=r"^kv-canary: key_cache is \[batch, heads, max_len, head_dim\]"):
        layouts.hf_static_cache(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, 5))


# A packed vLLM layer, logically [B, H, N, 2D], stored in the LBNHC order (N outside H).
LBNHC_LAYER = torch.zeros(5, 32, 2, 128, dtype=torch.bfloat16).permute(0, 2, 1, 3)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: layouts.vllm(torch.zeros(2, 4, 32, 2, 64)), "layouts.vllm needs layout="),
        (lambda: layouts.vllm(torch.zeros(4, 2, 32, 128), layout="LBHNC"), "needs backend="),
        (lambda: layouts.vllm(torch.zeros(4, 2, 32, 128), layout="LBHNC", backend="MAMBA2_ATTN"), "needs backend="),
        (lambda: layouts.vllm(torch.zeros(4, 2, 32, 128), layout="LBNHC", backend="FLASH_ATTN"), "LBNHC layer has its axes"),
        (lambda: layouts.vllm(torch.zeros(4, 2, 32, 128), layout="XYZ", backend="FLASH_ATTN"), "a packed vLLM layer is the 4-D"),
        (lambda: layouts.vllm(torch.zeros(2, 4, 32, 2, 64), layout="LBHNC"), "a 5-D vLLM layer is the legacy"),
        (lambda: layouts.vllm(torch.zeros(3, 4, 32, 2, 64), layout="NHD"), "a 5-D vLLM layer is the legacy"),
        (lambda: layouts.vllm(torch.zeros(2, 4, 32, 2, 64), layout="HND"), "HND layer has its axes"),
        (lambda: layouts.vllm(torch.zeros(4, 2, 32, 127), layout="LBHNC", backend="FLASH_ATTN"), "2 * head_size"),
        (lambda: layouts.vllm(LBNHC_LAYER, layout="LBNHC", backend="CPU_ATTN"), "reads each block-head"),
        (lambda: layouts.vllm(torch.zeros(4, 2, 32, 128), layout=3, backend="FLASH_ATTN"), "layout must be vLLM's name"),
    ],
)
def test_vllm_ambiguous_or_wrong_calls_are_refused(call, message):
    with pytest.raises((ValueError, TypeError), match="^kv-canary: .*" + re.escape(message)):
        call()


# --- fold on each device ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_fold_eager_range_check_and_switch(device):
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(-128, 127, (2, 64, 16, 2, 64), dtype=torch.int8, generator=gen).view(torch.bfloat16).to(device)
    sources = [kc.view_source(pool[i], read_bytes=kc.resolve_read_bytes(kc.HashMode.ALL)) for i in range(2)]
    capacity = pool.shape[1] * pool.shape[2]
    slots = torch.tensor([0, capacity, 3], device=device)
    with pytest.raises(IndexError, match=f"^kv-canary: slot {capacity} is out of range for sources of capacity {capacity}"):
        kc.fold(sources, slots)
    out = kc.fold(sources, slots, check_bounds=False)
    assert out[1] == 0 and out[0] != 0
