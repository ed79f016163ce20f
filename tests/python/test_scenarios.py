"""The ABI scenarios of testdata/scenarios (their README has the format),
run through ctypes: the same calls, statuses and message fragments as the
Go (capi) and C++ runners, and a failed call changes nothing observable."""

from __future__ import annotations

import ctypes
import pathlib
import re
from typing import Dict, List, Optional

import pytest

import abi_raw as raw
from abi_raw import Memory, get, layout, put, read_i32s

SCENARIOS = pathlib.Path(__file__).resolve().parents[2] / "testdata" / "scenarios"


class Value:
    def __init__(self, text: str) -> None:
        self.raw = text
        self.null = text == "NULL"
        self.lists: Optional[List[List[int]]] = None
        if text.startswith("["):
            self.lists = []
            for part in text.split("/"):
                if not (part.startswith("[") and part.endswith("]")):
                    raise ValueError(f"bad list {part!r}")
                items: List[int] = []
                for item in filter(None, part[1:-1].split(",")):
                    if ".." in item:
                        lo, hi = (int(x) for x in item.split(".."))
                        if hi < lo:
                            raise ValueError(f"bad range {item!r}")
                        items.extend(range(lo, hi + 1))
                    else:
                        items.append(int(item))
                self.lists.append(items)

    def list(self) -> List[int]:
        return self.lists[0] if self.lists else []


class Stmt:
    def __init__(self, path: pathlib.Path, line: int, text: str) -> None:
        self.where = f"{path.name}:{line}: {text}"
        self.frag = ""
        m = re.search(r'"(.*)"', text)
        if m:
            self.frag = m.group(1)
            text = text[: m.start()].strip()
        lhs, _, rhs = text.partition("->")
        if not _:
            raise ValueError(f"{self.where}: no '->'")
        words = lhs.split()
        self.call = words[0]
        self.args: Dict[str, Value] = {}
        for kv in words[1:]:
            k, _, v = kv.partition("=")
            self.args[k] = Value(v)
        res = rhs.split()
        self.want = res[0]
        self.outs = {}
        for kv in res[1:]:
            k, _, v = kv.partition("=")
            self.outs[k] = Value(v)


def parse(path: pathlib.Path):
    scenarios = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("scenario "):
            scenarios.append((line[len("scenario "):].strip(), []))
        else:
            scenarios[-1][1].append(Stmt(path, n, line))
    return scenarios


CASES = [(f"{p.stem}/{name}", stmts) for p in sorted(SCENARIOS.glob("*.txt")) for name, stmts in parse(p)]


STRING_FIELDS = {"endpoint", "replay_endpoint", "topic", "medium"}


class Runner:
    def __init__(self) -> None:
        self.m: Optional[int] = None
        self.c: Optional[int] = None
        self.helpers: List[tuple] = []
        self.junk = ctypes.create_string_buffer(64)
        self.stale: Dict[bool, int] = {}
        self.last_pin = 0
        self.pub: Optional[int] = None  # the current event publisher, on self.m
        self.stale_pub: Optional[int] = None
        self.mem = Memory()

    # -- arguments -----------------------------------------------------------
    def has(self, k): return k in self.st.args
    def null(self, k): return self.has(k) and self.st.args[k].null

    def int(self, k, default=0) -> int:
        return int(self.st.args[k].raw) if self.has(k) else default

    def list(self, k) -> List[int]:
        return self.st.args[k].list() if self.has(k) and not self.null(k) else []

    def array(self, k, elem) -> Optional[int]:
        if self.null(k):
            return None
        return self.mem.array(self.list(k), elem)

    def out(self, k, size) -> Optional[int]:
        return None if self.null(k) else self.mem.alloc(size)

    def struct_size(self, k, name) -> int:
        size, _ = layout(name)
        if not self.has(k):
            return size
        v = self.st.args[k].raw
        for sym, base in (("FULL", size), ("FIRST", raw.FIRST_MANAGER_CONFIG)):
            if v.startswith(sym):
                return base + (int(v[len(sym):]) if v[len(sym):] else 0)
        return int(v)

    def cstruct(self, arg, name, defaults=None, renames=None) -> Optional[int]:
        if self.null(arg):
            return None
        size, fields = layout(name)
        ss = self.struct_size("struct_size", name)
        p = self.mem.alloc(max(ss, size) + 8)
        ctypes.c_size_t.from_address(p).value = ss
        values = dict(defaults or {})
        for k in self.st.args:
            f = (renames or {}).get(k, k)
            if f in STRING_FIELDS and f in fields:
                text = None if self.null(k) else self.st.args[k].raw.encode() + b"\0"
                sp = self.mem.alloc(len(text)) if text else None
                if text:
                    ctypes.memmove(sp, text, len(text))
                ctypes.c_void_p.from_address(p + fields[f][0]).value = sp
            elif f in fields and f != "struct_size":
                values[f] = self.int(k)
        for f, v in values.items():
            put(p, fields[f][0], fields[f][1], v)
        if self.has("byte"):
            b = self.st.args["byte"].raw
            off = self.struct_size("byte", name) if b.startswith("FULL") else int(b)
            ctypes.c_uint8.from_address(p + off).value = 1
        return p

    def read_struct(self, name, p) -> None:
        for f, (off, size) in layout(name)[1].items():
            if size in (4, 8) and f != "struct_size":
                self.results[f] = get(p, off, size)

    def handle(self, k, manager: bool) -> Optional[int]:
        cur = self.m if manager else self.c
        if not self.has(k):
            return cur
        v = self.st.args[k].raw
        if v == "NULL":
            return None
        if v == "junk":
            return ctypes.addressof(self.junk)
        if v == "stale":
            if manager not in self.stale:
                h = self.new_manager() if manager else self.new_vcache()
                raw.call("kvp_manager_destroy" if manager else "kvp_vcache_destroy", h)
                self.stale[manager] = h
            return self.stale[manager]
        if v == "other":
            other = self.c if manager else self.m
            if other is not None:
                return other
            h = self.new_vcache() if manager else self.new_manager()
            self.helpers.append((not manager, h))
            return h
        raise AssertionError(f"unknown handle {k}={v}")

    def new_manager(self) -> int:
        cfg = raw.manager.ManagerConfig(ctypes.sizeof(raw.manager.ManagerConfig), 4, 4)
        out = ctypes.c_void_p()
        assert raw.call("kvp_manager_create", ctypes.addressof(cfg), ctypes.addressof(out)) == 0, raw.last_error()
        return out.value

    def new_vcache(self) -> int:
        cfg = raw.vmem.VCacheConfig()
        cfg.struct_size = ctypes.sizeof(cfg)
        cfg.backend, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim = 1, 1, 1, 64
        cfg.max_batch, cfg.max_context, cfg.budget_bytes = 1, 64, 1 << 20
        out = ctypes.c_void_p()
        assert raw.call("kvp_vcache_create", ctypes.addressof(cfg), ctypes.addressof(out)) == 0, raw.last_error()
        return out.value

    # -- observation ---------------------------------------------------------
    def snapshot(self) -> bytes:
        snap = b""
        mem = Memory()
        if self.m is not None:
            for fn, name in (("kvp_manager_stats_get", "kvp_manager_stats"), ("kvp_manager_prefix_stats", "kvp_prefix_stats")):
                size, _ = layout(name)
                p = mem.alloc(size)
                ctypes.c_size_t.from_address(p).value = size
                assert raw.call(fn, self.m, p) == 0, raw.last_error()
                if name == "kvp_prefix_stats" and self.pub:
                    # A running publisher drains the manager's events on its
                    # own thread: the pending count moves between any two calls.
                    put(p, *layout(name)[1]["pending_events"], 0)
                snap += ctypes.string_at(p, size)
        if self.c is not None:
            size, fields = layout("kvp_vcache_stats")
            p = mem.alloc(size)
            ctypes.c_size_t.from_address(p).value = size
            assert raw.call("kvp_vcache_stats_get", self.c, p) == 0, raw.last_error()
            # Refusals and times are counted even by calls that change nothing.
            for f in ("page_size", "budget_bytes", "tensor_bytes", "mapped_bytes", "held_bytes", "active_slots",
                      "reusable_slots", "steps", "map_calls", "unmap_calls", "create_calls", "release_calls"):
                snap += ctypes.string_at(p + fields[f][0], fields[f][1])
        return snap

    def close(self) -> None:
        raw.call("kvp_event_publisher_destroy", self.pub)  # before its manager, as the header asks
        for h in (self.m,):
            if h is not None:
                raw.call("kvp_manager_destroy", h)
        if self.c is not None:
            raw.call("kvp_vcache_destroy", self.c)
        for is_manager, h in self.helpers:
            raw.call("kvp_manager_destroy" if is_manager else "kvp_vcache_destroy", h)

    # -- one statement -------------------------------------------------------
    def run(self, st: Stmt) -> None:
        self.st, self.results = st, {}
        want = "KVP_OK" if st.want == "OK" else "KVP_ERR_" + st.want
        before = self.snapshot() if st.want != "OK" else None
        try:
            got = self.dispatch()
            assert raw.status_name(got) == want, f"{st.where}\n  status {raw.status_name(got)}, want {want} ({raw.last_error()})"
            if got:
                msg = raw.last_error()
                assert msg, f"{st.where}\n  failed without a message"
                assert st.frag in msg, f"{st.where}\n  message {msg!r} lacks {st.frag!r}"
                assert self.snapshot() == before, f"{st.where}\n  a failed call changed the state"
            for k, v in st.outs.items():
                assert k in self.results, f"{st.where}\n  the call has no output {k}"
                g = self.results[k]
                w = v.list() if isinstance(g, list) else int(v.raw)
                assert g == w, f"{st.where}\n  output {k} = {g}, want {w}"
            if self.m is not None:
                assert raw.call("kvp_manager_check", self.m) == 0, f"{st.where}\n  invariants: {raw.last_error()}"
        finally:
            self.mem.release()

    def dispatch(self) -> int:  # noqa: C901 - one branch per call, as the README's table
        call, a, M = self.st.call, self.st.args, self.mem
        m = lambda: self.handle("m", True)  # noqa: E731
        c = lambda: self.handle("c", False)  # noqa: E731
        if call == "manager_create":
            cfg = self.cstruct("cfg", "kvp_manager_config", renames={"prefix_cache": "enable_prefix_cache",
                                                                     "kv_events": "enable_kv_events"})
            out = self.out("out", 8)
            s = raw.call("kvp_manager_create", cfg, out)
            if s == 0:
                raw.call("kvp_event_publisher_destroy", self.pub)
                self.pub = None
                if self.m is not None:
                    raw.call("kvp_manager_destroy", self.m)
                self.m = ctypes.c_void_p.from_address(out).value
            return s
        if call in ("manager_destroy", "vcache_destroy"):
            is_m = call == "manager_destroy"
            raw.call("kvp_" + call, m() if is_m else c())
            if not self.has("m" if is_m else "c"):
                if is_m:
                    self.m = None
                else:
                    self.c = None
            return 0
        if call == "manager_add":
            return raw.call("kvp_manager_add", m(), self.int("id"), self.int("prompt_len"))
        if call == "manager_mark_computed":
            return raw.call("kvp_manager_mark_computed", m())
        if call in ("manager_grow", "manager_grow_tokens", "manager_remove"):
            n = self.int("n", len(self.list("ids")))
            if call == "manager_remove":
                return raw.call("kvp_manager_remove", m(), self.array("ids", 8), n)
            args = [m(), self.array("ids", 8), self.array("counts", 4), n]
            if call == "manager_grow_tokens":
                args.append(self.array("tokens", 4))
            return raw.call("kvp_" + call, *args)
        if call == "manager_fork":
            n = self.int("n", len(self.list("children")))
            mc = self.int("max_copies")
            num = self.out("num_copies", 4)
            s = raw.call("kvp_manager_fork", m(), self.int("parent"), self.array("children", 8), n,
                         self.out("copies", 8 * max(mc, 0)), mc, num)
            if s == 0:
                self.results["num_copies"] = read_i32s(num, 1)[0]
            return s
        if call == "manager_describe":
            n = self.int("n", len(self.list("ids")))
            mb, cap = self.int("max_blocks"), self.int("slot_capacity")
            lens, num = self.out("seq_lens", 4 * max(n, 0)), self.out("num_slots", 4)
            s = raw.call("kvp_manager_describe", m(), self.array("ids", 8), n, self.out("block_table", 4 * max(n, 0) * max(mb, 0)),
                         mb, lens, self.out("slot_mapping", 4 * max(cap, 0)), cap, num)
            if s == 0:
                self.results["num_slots"] = read_i32s(num, 1)[0]
                self.results["seq_lens"] = read_i32s(lens, n)
            return s
        if call in ("manager_stats_get", "manager_prefix_stats", "vcache_stats_get"):
            name = {"manager_stats_get": "kvp_manager_stats", "manager_prefix_stats": "kvp_prefix_stats",
                    "vcache_stats_get": "kvp_vcache_stats"}[call]
            out = self.cstruct("out", name)
            s = raw.call("kvp_" + call, c() if call.startswith("vcache") else m(), out)
            if s == 0:
                self.read_struct(name, out)
            return s
        if call in ("manager_admit", "manager_match"):
            prompts = a["prompts"].lists
            n = self.int("n", len(prompts))
            toks = [t for p in prompts for t in p]
            offs = [0]
            for p in prompts:
                offs.append(offs[-1] + len(p))
            tokens = None if self.null("tokens") else M.array(toks, 4)
            offsets = self.array("offsets", 8) if self.has("offsets") else M.array(offs, 8)
            keys = self.keys(len(prompts))
            if call == "manager_match":
                out = self.out("out", 12 * max(len(prompts), 1))
                s = raw.call("kvp_manager_match", m(), n, tokens, offsets, keys, self.int("partial"), out)
                if s == 0:
                    vals = read_i32s(out, 3 * len(prompts))
                    for j, k in enumerate(("matched", "partial_block", "partial_tokens")):
                        self.results[k] = vals[j::3]
                return s
            matched, num = M.alloc(4 * max(len(prompts), 1)), self.out("num_admitted", 4)
            s = raw.call("kvp_manager_admit", m(), self.array("ids", 8), n, tokens, offsets, keys, matched, num)
            if s == 0:
                k = read_i32s(num, 1)[0]
                self.results["num_admitted"], self.results["matched"] = k, read_i32s(matched, k)
            return s
        if call in ("manager_pin", "manager_set_priority"):
            n = self.int("num_tokens", len(self.list("tokens")))
            nb = M.alloc(4)
            if call == "manager_set_priority":
                s = raw.call("kvp_manager_set_priority", m(), self.array("tokens", 4), n, None, self.int("priority"), nb)
            else:
                pid = self.out("pin_id", 8)
                s = raw.call("kvp_manager_pin", m(), self.array("tokens", 4), n, None, pid, nb)
                if s == 0:
                    self.last_pin = ctypes.c_uint64.from_address(pid).value
            if s == 0:
                self.results["num_blocks"] = read_i32s(nb, 1)[0]
            return s
        if call == "manager_unpin":
            pid = self.last_pin if a["pin_id"].raw == "last" else self.int("pin_id")
            return raw.call("kvp_manager_unpin", m(), pid)
        if call == "manager_clear_prefix_cache":
            num = M.alloc(4)
            s = raw.call("kvp_manager_clear_prefix_cache", m(), num)
            if s == 0:
                self.results["num_freed"] = read_i32s(num, 1)[0]
            return s
        if call == "manager_drain_events":
            me, mt, mm, mh = (self.int(k) for k in ("max_events", "max_tokens", "max_mm", "max_hashes"))
            num = self.out("num_events", 4)
            s = raw.call("kvp_manager_drain_events", m(), self.out("events", layout("kvp_kv_event")[0] * max(me, 1)), me,
                         self.out("tokens", 4 * max(mt, 1)), mt, M.alloc(layout("kvp_block_mm")[0] * max(mm, 1)), mm,
                         M.alloc(16 * max(mh, 1)), mh, num)
            if s == 0:
                self.results["num_events"] = read_i32s(num, 1)[0]
            return s
        if call == "manager_next_event_size":
            t, mm, h = M.alloc(4), M.alloc(4), M.alloc(4)
            s = raw.call("kvp_manager_next_event_size", m(), t, mm, h)
            if s == 0:
                for k, p in (("tokens", t), ("mm", mm), ("hashes", h)):
                    self.results[k] = read_i32s(p, 1)[0]
            return s
        if call == "manager_add_mm_items":
            assert self.null("items"), "only items=NULL is supported"
            return raw.call("kvp_manager_add_mm_items", m(), self.int("seq_id"), None, self.int("num_items"))
        if call == "vcache_create":
            cfg = self.cstruct("cfg", "kvp_vcache_config", defaults={"backend": 1, "no_background": 1})
            out = self.out("out", 8)
            s = raw.call("kvp_vcache_create", cfg, out)
            if s == 0:
                if self.c is not None:
                    raw.call("kvp_vcache_destroy", self.c)
                self.c = ctypes.c_void_p.from_address(out).value
            return s
        if call == "vcache_alloc_slot":
            slot = self.out("slot", 4)
            s = raw.call("kvp_vcache_alloc_slot", c(), slot)
            if s == 0:
                self.results["slot"] = read_i32s(slot, 1)[0]
            return s
        if call == "vcache_free_slot":
            return raw.call("kvp_vcache_free_slot", c(), self.int("slot"))
        if call == "vcache_step":
            n = self.int("n", len(self.list("slots")))
            return raw.call("kvp_vcache_step", c(), self.array("slots", 4), self.array("ctx_lens", 4), n)
        if call == "vcache_layer_ptrs":
            return raw.call("kvp_vcache_layer_ptrs", c(), self.int("layer"), self.out("k_ptr", 8), self.out("v_ptr", 8))
        if call == "vcache_strides":
            return raw.call("kvp_vcache_strides", c(), self.out("strides", 32))
        if call == "vcache_trim":
            return raw.call("kvp_vcache_trim", c())
        if call in ("attn_workspace_size", "prefill_workspace_size"):
            names = (("max_batch", "num_q_heads", "head_dim", "max_splits") if call == "attn_workspace_size"
                     else ("max_batch", "max_tokens", "num_q_heads", "num_kv_heads", "head_dim"))
            out = self.out("out", 8)
            s = raw.call("kvp_" + call, *(self.int(k) for k in names), out)
            if s == 0:
                self.results["bytes"] = ctypes.c_uint64.from_address(out).value
            return s
        if call == "attn_num_splits":
            out = self.out("out", 4)
            s = raw.call("kvp_attn_num_splits", *(self.int(k) for k in ("dtype", "head_dim", "batch", "num_q_heads",
                                                                         "num_kv_heads", "max_seq_len")), out)
            if s == 0:
                self.results["splits"] = read_i32s(out, 1)[0]
            return s
        structs = {"kv_write": "kvp_kv_write_args", "paged_decode": "kvp_paged_decode_args",
                   "merge_states": "kvp_merge_states_args", "prefill_plan": "kvp_prefill_plan_args",
                   "paged_prefill": "kvp_paged_prefill_args"}
        if call in structs:
            args = self.cstruct("args", structs[call])
            if call not in ("prefill_plan", "paged_prefill"):
                return raw.call("kvp_" + call, args, 0)
            size, _ = layout("kvp_attn_plan")
            plan = M.alloc(size)
            ctypes.c_size_t.from_address(plan).value = size
            if call == "prefill_plan":
                return raw.call("kvp_prefill_plan", args, plan, 0)
            return raw.call("kvp_paged_prefill", plan, args, 0)
        return self.dispatch_more()

    def dispatch_more(self) -> int:
        """The shared-prefix attention and event publisher calls."""
        call, M = self.st.call, self.mem
        plan_size = layout("kvp_attn_plan")[0]

        def plan():
            p = M.alloc(plan_size)
            ctypes.c_size_t.from_address(p).value = plan_size
            return p

        if call == "cascade_workspace_size":
            dev, host = self.out("device_bytes", 8), self.out("host_bytes", 8)
            s = raw.call("kvp_cascade_workspace_size", *(self.int(k) for k in ("max_batch", "num_q_heads", "num_kv_heads",
                                                                               "head_dim")), dev, host)
            if s == 0:
                self.results["device_bytes"] = ctypes.c_uint64.from_address(dev).value
                self.results["host_bytes"] = ctypes.c_uint64.from_address(host).value
            return s
        if call == "cascade_plan":
            return raw.call("kvp_cascade_plan", self.cstruct("args", "kvp_cascade_plan_args"), plan(), 0)
        if call == "cascade_update":
            batch = self.int("batch")
            lens = None if self.null("seq_lens_host") else M.array(self.list("seq_lens_host") or [0] * max(batch, 0), 4)
            return raw.call("kvp_cascade_update", None if self.null("plan") else plan(), lens, batch, self.out("fits", 4))
        if call == "paged_cascade":
            return raw.call("kvp_paged_cascade", plan(), self.cstruct("args", "kvp_paged_prefill_args"), 0)
        if call == "event_publisher_create":
            cfg = self.cstruct("cfg", "kvp_event_publisher_config")
            out = self.out("out", 8)
            s = raw.call("kvp_event_publisher_create", self.handle("m", True), cfg, out)
            if s == 0:
                raw.call("kvp_event_publisher_destroy", self.pub)
                self.pub = ctypes.c_void_p.from_address(out).value
            return s
        if call in ("event_publisher_flush", "event_publisher_resync"):
            return raw.call("kvp_" + call, self.publisher())
        if call == "event_publisher_stats_get":
            out = self.cstruct("out", "kvp_event_publisher_stats")
            s = raw.call("kvp_event_publisher_stats_get", self.publisher(), out)
            if s == 0:
                self.read_struct("kvp_event_publisher_stats", out)
            return s
        if call == "event_publisher_destroy":
            raw.call("kvp_event_publisher_destroy", self.publisher())
            if not self.has("p"):
                self.pub = None
            return 0
        raise AssertionError(f"{self.st.where}: unknown call {call}")

    def publisher(self) -> Optional[int]:
        if not self.has("p"):
            return self.pub
        v = self.st.args["p"].raw
        if v == "NULL":
            return None
        if v == "junk":
            return ctypes.addressof(self.junk)
        if v == "other":
            return self.m
        if v == "stale":
            if self.stale_pub is None:
                cfg = raw.manager.ManagerConfig(ctypes.sizeof(raw.manager.ManagerConfig), 4, 4, 1, 1)
                out = ctypes.c_void_p()
                assert raw.call("kvp_manager_create", ctypes.addressof(cfg), ctypes.addressof(out)) == 0
                pc = raw.events.EventPublisherConfig()
                pc.struct_size = ctypes.sizeof(pc)
                pc.endpoint = b"tcp://127.0.0.1:0"
                pub = ctypes.c_void_p()
                assert raw.call("kvp_event_publisher_create", out.value, ctypes.addressof(pc), ctypes.addressof(pub)) == 0, \
                    raw.last_error()
                raw.call("kvp_event_publisher_destroy", pub.value)
                raw.call("kvp_manager_destroy", out.value)
                self.stale_pub = pub.value
            return self.stale_pub
        raise AssertionError(f"unknown publisher p={v}")

    def keys(self, n: int) -> Optional[int]:
        if not self.has("salt_len") and not self.has("num_mm"):
            return None
        size, fields = layout("kvp_prefix_keys")
        p = self.mem.alloc(size * max(n, 1))
        salt = self.mem.alloc(max(self.int("salt_len"), 1))
        for i in range(n):
            put(p + i * size, *fields["salt_len"], self.int("salt_len"))
            ctypes.c_void_p.from_address(p + i * size + fields["salt"][0]).value = salt
            put(p + i * size, *fields["num_mm"], self.int("num_mm"))
        return p


@pytest.mark.parametrize("stmts", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_scenario(stmts):
    r = Runner()
    try:
        for st in stmts:
            r.run(st)
    finally:
        r.close()


def test_the_scenario_files_are_there():
    names = {c[0].split("/")[0] for c in CASES}
    assert {"bad_inputs", "eviction", "admission"} <= names
    assert sum(len(c[1]) for c in CASES) > 150


def test_values_parse_as_the_readme_says():
    v = Value("[1,3..5,-2]/[]")
    assert v.lists == [[1, 3, 4, 5, -2], []]
    assert Value("NULL").null
    for bad in ("[5..3]", "[1,2"):
        with pytest.raises(ValueError):
            Value(bad)
