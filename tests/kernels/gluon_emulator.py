# SPDX-License-Identifier: Apache-2.0
"""CPU emulation of the Gluon kernels of kernels/triton_sparse_mla_v2.py (test helper).

Gluon kernels do not run in Triton's interpreter. This runs their Python bodies, program by
program, with stand-ins for ``gl`` / ``cp`` / ``mma_v2`` built on torch CPU tensors: layouts are
ignored (every tensor is whole), pointers are (byte buffer, dtype, byte offsets) and every
dereference is bounds-checked, shared memory starts as NaN / 0x7F garbage, and ``cp.async``
copies land in shared memory only when a ``wait_group`` retires their group (masked lanes are
zero-filled), so a read of a ring stage before its wait sees garbage. What it checks: the
kernel's indexing, masking, ring-stage order, online softmax and epilogue -- not its layouts,
the hardware's barriers or its speed (those need the GPU).
"""

from __future__ import annotations

import types

import torch

# ------------------------------------------------------------------------------------------
# values
# ------------------------------------------------------------------------------------------


def _a(x):
    return x.a if isinstance(x, T) else x


class T:
    """A distributed tensor (the whole tensor; layouts are ignored)."""

    def __init__(self, a):
        self.a = a if isinstance(a, torch.Tensor) else torch.tensor(a)

    shape = property(lambda self: list(self.a.shape))
    dtype = property(lambda self: self.a.dtype)

    def _bin(self, o, f):
        o = _a(o)
        if isinstance(o, Ptr):
            return NotImplemented
        return T(f(self.a, o))

    __add__ = lambda s, o: s._bin(o, lambda a, b: a + b)
    __radd__ = lambda s, o: s._bin(o, lambda a, b: b + a)
    __sub__ = lambda s, o: s._bin(o, lambda a, b: a - b)
    __rsub__ = lambda s, o: s._bin(o, lambda a, b: b - a)
    __mul__ = lambda s, o: s._bin(o, lambda a, b: a * b)
    __rmul__ = lambda s, o: s._bin(o, lambda a, b: b * a)
    __truediv__ = lambda s, o: s._bin(o, lambda a, b: a / b)
    __rtruediv__ = lambda s, o: s._bin(o, lambda a, b: b / a)
    __floordiv__ = lambda s, o: s._bin(o, lambda a, b: torch.div(a, b, rounding_mode="trunc"))
    __mod__ = lambda s, o: s._bin(o, lambda a, b: torch.fmod(a, b) if isinstance(a, torch.Tensor) else a % b)
    __lt__ = lambda s, o: s._bin(o, lambda a, b: a < b)
    __le__ = lambda s, o: s._bin(o, lambda a, b: a <= b)
    __gt__ = lambda s, o: s._bin(o, lambda a, b: a > b)
    __ge__ = lambda s, o: s._bin(o, lambda a, b: a >= b)
    __eq__ = lambda s, o: s._bin(o, lambda a, b: a == b)
    __ne__ = lambda s, o: s._bin(o, lambda a, b: a != b)
    __hash__ = object.__hash__
    __and__ = lambda s, o: s._bin(o, lambda a, b: a & b)
    __or__ = lambda s, o: s._bin(o, lambda a, b: a | b)
    __neg__ = lambda s: T(-s.a)

    def __getitem__(self, k):
        return T(self.a[k])

    def __bool__(self):
        return bool(self.a)

    def __index__(self):
        return int(self.a)

    __int__ = __index__

    def to(self, dtype, bitcast=False):
        if isinstance(dtype, PtrType):
            raise TypeError("tensor -> pointer cast")
        return T(self.a.view(dtype) if bitcast else self.a.to(dtype))


class PtrType:
    def __init__(self, dt):
        self.element_ty = dt


class Ptr:
    """Pointer(s): a byte buffer, an element dtype and byte offsets (int or int64 tensor)."""

    def __init__(self, buf, dt, off):
        self.buf, self.dt, self.off = buf, dt, off

    @staticmethod
    def of(t: torch.Tensor) -> "Ptr":
        buf = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        return Ptr(buf, t.dtype, t.storage_offset() * t.element_size())

    dtype = property(lambda self: PtrType(self.dt))

    def _es(self):
        return torch.empty((), dtype=self.dt).element_size()

    def __add__(self, o):
        o = _a(o)
        if isinstance(o, torch.Tensor):
            o = o.to(torch.int64)
        return Ptr(self.buf, self.dt, self.off + o * self._es())

    __radd__ = __add__

    def __getitem__(self, k):
        return Ptr(self.buf, self.dt, self.off[k])

    def to(self, pt):
        assert isinstance(pt, PtrType)
        return Ptr(self.buf, pt.element_ty, self.off)

    def _idx(self, mask):
        off = self.off if isinstance(self.off, torch.Tensor) else torch.tensor(self.off, dtype=torch.int64)
        if mask is None:
            mask = torch.ones_like(off, dtype=torch.bool)
        off, mask = torch.broadcast_tensors(off, _a(mask))
        es = self._es()
        assert (off[mask] % es == 0).all(), "misaligned access"
        idx = torch.where(mask, off, 0)[..., None] + torch.arange(es)
        hi = idx[mask].max().item() if mask.any() else -1
        lo = idx[mask].min().item() if mask.any() else 0
        assert lo >= 0 and hi < self.buf.numel(), f"out-of-bounds access: bytes [{lo}, {hi}] of {self.buf.numel()}"
        return idx, mask, es

    def load(self, mask=None, other=None):
        idx, mask, es = self._idx(mask)
        raw = torch.zeros(idx.shape, dtype=torch.uint8)
        if mask.any():  # masked lanes are never dereferenced
            raw[mask] = self.buf[idx[mask]]
        vals = raw.view(self.dt)[..., 0]
        fill = torch.zeros((), dtype=self.dt) if other is None else torch.tensor(other).to(self.dt)
        return torch.where(mask, vals, fill)

    def store(self, val, mask=None):
        idx, mask, es = self._idx(mask)
        v = torch.broadcast_to(_a(val).to(self.dt) if isinstance(_a(val), torch.Tensor)
                               else torch.tensor(_a(val)).to(self.dt), idx.shape[:-1])
        b = v.contiguous().reshape(-1).view(torch.uint8).view(*idx.shape)
        self.buf[idx[mask]] = b[mask]


class Smem:
    """A shared-memory descriptor (a view of one allocation)."""

    def __init__(self, t, arena):
        self.t, self.arena = t, arena

    shape = property(lambda self: list(self.t.shape))

    def slice(self, start, length, dim=0):
        return Smem(self.t.narrow(dim, int(start), int(length)), self.arena)

    def index(self, i):
        return Smem(self.t[int(i)], self.arena)

    def permute(self, order):
        return Smem(self.t.permute(*order), self.arena)

    def load(self, layout=None):
        return T(self.t.clone())

    def store(self, v):
        v = _a(v)
        assert list(v.shape) == list(self.t.shape), f"smem store shape {list(v.shape)} into {list(self.t.shape)}"
        self.t.copy_(v.to(self.t.dtype))


class Arena:
    """Shared memory + the async-copy groups of one program."""

    def __init__(self):
        self.pending, self.groups = [], []

    def issue(self, smem, data):
        self.pending.append((smem, data))

    def commit(self):
        self.groups.append(self.pending)
        self.pending = []

    def wait(self, n):
        while len(self.groups) > n:
            for smem, data in self.groups.pop(0):
                smem.t.copy_(data)

    def done(self):
        assert not self.pending and not self.groups, "async copies still in flight when the program ends"


# ------------------------------------------------------------------------------------------
# gl / cp / mma_v2 stand-ins
# ------------------------------------------------------------------------------------------

_PROGRAM = {"pid": 0, "arena": None}


def _garbage(shape, dt):
    t = torch.empty(shape, dtype=dt)
    if dt.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(0x7F)
    return t


def _tt(x):
    return x if isinstance(x, torch.Tensor) else torch.tensor(x)


def make_gl():
    g = types.SimpleNamespace()
    for name in ("int1", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16", "float32", "float64"):
        setattr(g, name, getattr(torch, {"int1": "bool"}.get(name, name)))
    g.float8e4nv = torch.float8_e4m3fn
    g.constexpr = object
    layout = lambda *a, **k: None  # noqa: E731
    for name in ("NVMMADistributedLayout", "DotOperandLayout", "SliceLayout", "BlockedLayout", "SwizzledSharedLayout",
                 "NVMMASharedLayout"):
        setattr(g, name, layout)
    g.pointer_type = PtrType
    g.program_id = lambda axis: T(torch.tensor(_PROGRAM["pid"], dtype=torch.int32))
    g.arange = lambda s, e, layout=None: T(torch.arange(s, e, dtype=torch.int32))
    g.full = lambda shape, value, dtype, layout=None: T(torch.full(list(shape), value, dtype=dtype))
    g.static_range = range
    g.cdiv = lambda a, b: (a + b - 1) // b
    g.maximum = lambda a, b: (T(torch.maximum(_tt(_a(a)), _tt(_a(b))))
                              if isinstance(a, T) or isinstance(b, T) else max(a, b))
    g.minimum = lambda a, b: (T(torch.minimum(_tt(_a(a)), _tt(_a(b))))
                              if isinstance(a, T) or isinstance(b, T) else min(a, b))

    def where(c, a, b):
        a, b = _a(a), _a(b)
        c = _a(c)
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a = torch.tensor(a, dtype=torch.float32)
        return T(torch.where(c, a, b))

    g.where = where
    g.max = lambda x, axis: T(torch.amax(_a(x), dim=axis))
    g.sum = lambda x, axis: T(torch.sum(_a(x), dim=axis))
    g.exp2 = lambda x: T(torch.exp2(_a(x)))
    g.log2 = lambda x: T(torch.log2(_a(x)))
    g.convert_layout = lambda x, layout, assert_trivial=False: x
    g.thread_barrier = lambda: None

    def load(ptr, mask=None, other=None, cache_modifier=""):
        return T(ptr.load(mask, other))

    def store(ptr, val, mask=None):
        ptr.store(val, mask)

    g.load, g.store = load, store
    g.zeros = lambda shape, dtype, layout=None: T(torch.zeros(list(shape), dtype=dtype))
    g.abs = lambda x: T(torch.abs(_a(x)))
    g.ceil = lambda x: T(torch.ceil(_a(x)))

    def atomic(op):
        def rmw(ptr, val, mask=None, sem=None, scope=None):
            # scalar read-modify-write (programs run one after another: atomic by construction)
            assert not isinstance(ptr.off, torch.Tensor) or ptr.off.dim() == 0, "scalar atomics only"
            old = ptr.load()
            ptr.store(op(old, _a(val)))
            return T(old)
        return rmw

    g.atomic_add = atomic(lambda old, v: old + v)
    g.atomic_xchg = atomic(lambda old, v: torch.as_tensor(v))

    def allocate_shared_memory(dt, shape, layout, value=None):
        return Smem(_garbage(list(shape), dt), _PROGRAM["arena"])

    g.allocate_shared_memory = allocate_shared_memory
    return g


def make_cp():
    c = types.SimpleNamespace()

    def async_copy_global_to_shared(smem, pointer, mask=None):
        data = pointer.load(mask, 0)
        assert list(data.shape) == smem.shape, f"cp.async shape {list(data.shape)} into {smem.shape}"
        smem.arena.issue(smem, data.to(smem.t.dtype))

    c.async_copy_global_to_shared = async_copy_global_to_shared
    c.commit_group = lambda: _PROGRAM["arena"].commit()
    c.wait_group = lambda n=0: _PROGRAM["arena"].wait(int(n))
    return c


def _mma_v2(a, b, acc, input_precision=None):
    a, b, acc = _a(a), _a(b), _a(acc)
    assert a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype and acc.dtype == torch.float32
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), "MMA operand read uninitialized shared memory"
    return T(a.float() @ b.float() + acc)


def emulated(module, name: str):
    """The Python body of Gluon kernel ``module.name`` with every Gluon helper of the module rebuilt
    on the stand-ins (one shared globals dict)."""
    g = dict(module.__dict__)
    g.update(gl=make_gl(), cp=make_cp(), mma_v2=_mma_v2, _cta_barrier=lambda: None)
    for k, v in list(g.items()):
        if type(v).__name__ == "constexpr":  # module-level gl.constexpr globals: their values
            g[k] = v.value
        if type(v).__name__ == "GluonJITFunction":
            f = v.fn
            g[k] = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
    return g[name]


class EmulatedLaunch:
    """Stands in for ``kernel[grid](*args, **meta)``: runs every program in turn on CPU tensors."""

    def __init__(self, module, name):
        self.fn = emulated(module, name)
        self.launches = 0
        # program order: None = ascending pid; else a function n -> a permutation of range(n)
        # (e.g. to make another program than the last split the last arriver of a fused merge)
        self.order = None

    def __getitem__(self, grid):
        def run(*args, num_warps=None, maxnreg=None, num_stages=None, **consts):
            conv = [Ptr.of(a) if isinstance(a, torch.Tensor) else a for a in args]
            n = grid[0] if isinstance(grid, tuple) else grid
            for pid in (range(n) if self.order is None else self.order(n)):
                _PROGRAM["pid"] = pid
                _PROGRAM["arena"] = Arena()
                self.fn(*conv, **consts)
                _PROGRAM["arena"].done()
            self.launches += 1
        return run
