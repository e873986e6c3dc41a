"""The verbs layer on pyverbs, rdma-core's Python bindings (the `rdma` extra).

pyverbs is not on PyPI: it comes with the OS (Debian/Ubuntu `python3-pyverbs`, with
`rdma-core` and `ibverbs-providers`; Fedora/RHEL `python3-pyverbs`). A virtual environment does
not see the OS packages, so when `import pyverbs` fails here the OS directory is appended to
sys.path once (last, so nothing of the environment is shadowed); the OS build must match this
Python's version (Debian 12's is for 3.11). Checked on such a machine without an RDMA device:
everything imports and the attribute objects below build, `get_device_list()` raises.

The attribute builders (`init_attr`, `rtr_attr`, `rts_attr`, `send_chain`) are plain functions
so that what reaches ibv_modify_qp and ibv_post_send can be checked without a device.
"""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dualpath_ray.runtime.transport.verbs_layer import (
    LINK_ETHERNET,
    LINK_INFINIBAND,
    Completion,
    MemoryKeys,
    PathAttributes,
    PortAttributes,
    SendAttributes,
    VerbsError,
    VerbsLayer,
    WorkOp,
    WorkRequest,
)

OS_PACKAGES = Path("/usr/lib/python3/dist-packages")
_MODULES = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "enums", "pyverbs_error")
_MISSING = (
    "runtime.transport: verbs needs pyverbs, rdma-core's Python bindings, which are not on PyPI: install the "
    "OS package (Debian/Ubuntu: apt-get install python3-pyverbs rdma-core ibverbs-providers) for this Python "
    "({version}), or use runtime.transport: nixl or gloo"
)


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules by short name; VerbsError naming the package to install if missing."""
    try:
        return _import_modules()
    except ImportError:
        if OS_PACKAGES.is_dir() and str(OS_PACKAGES) not in sys.path:
            sys.path.append(str(OS_PACKAGES))
    try:
        return _import_modules()
    except ImportError as exc:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise VerbsError(f"{_MISSING.format(version=version)} ({exc})") from exc


def _import_modules() -> SimpleNamespace:
    return SimpleNamespace(**{name: importlib.import_module(f"pyverbs.{name}") for name in _MODULES})


def _mtu_enum(pv: SimpleNamespace, mtu: int) -> int:
    return int(getattr(pv.enums, f"IBV_MTU_{mtu}"))


def init_attr(pv: SimpleNamespace, port: int) -> Any:
    """RESET -> INIT: the port, and remote reads and writes allowed into this PD's regions."""
    e = pv.enums
    attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT)
    attr.port_num = port
    attr.pkey_index = 0
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
    return attr


def rtr_attr(pv: SimpleNamespace, path: PathAttributes) -> Any:
    """INIT -> RTR: the remote queue pair, and the address vector with the KV service level
    (and on RoCE the GRH traffic class)."""
    grh = None
    if path.is_global:
        grh = pv.addr.GlobalRoute(
            dgid=pv.addr.GID(val=path.remote.gid), sgid_index=path.gid_index, traffic_class=path.traffic_class,
            hop_limit=64,
        )
    attr = pv.qp.QPAttr(qp_state=pv.enums.IBV_QPS_RTR)
    attr.ah_attr = pv.addr.AHAttr(
        port_num=path.port, is_global=int(path.is_global), gr=grh, dlid=path.remote.lid, sl=path.service_level,
    )
    attr.path_mtu = _mtu_enum(pv, path.path_mtu)
    attr.dest_qp_num = path.remote.qp_num
    attr.rq_psn = path.remote.psn
    attr.max_dest_rd_atomic = path.max_dest_rd_atomic
    attr.min_rnr_timer = path.min_rnr_timer
    return attr


def rts_attr(pv: SimpleNamespace, send: SendAttributes) -> Any:
    attr = pv.qp.QPAttr(qp_state=pv.enums.IBV_QPS_RTS)
    attr.sq_psn = send.psn
    attr.timeout = send.timeout
    attr.retry_cnt = send.retry_count
    attr.rnr_retry = send.rnr_retry
    attr.max_rd_atomic = send.max_rd_atomic
    return attr


def send_chain(pv: SimpleNamespace, chain: Sequence[WorkRequest]) -> list[Any]:
    """SendWRs linked through `next`, head first. The caller keeps the list alive until
    post_send returned: each link is a pointer into the next SendWR."""
    e = pv.enums
    opcodes = {WorkOp.RDMA_READ: e.IBV_WR_RDMA_READ, WorkOp.RDMA_WRITE: e.IBV_WR_RDMA_WRITE}
    wrs = []
    for request in chain:
        sge = pv.wr.SGE(request.local_address, request.length, request.lkey)
        flags = e.IBV_SEND_SIGNALED if request.signaled else 0
        wr = pv.wr.SendWR(wr_id=request.wr_id, opcode=opcodes[request.op], num_sge=1, sg=[sge], send_flags=flags)
        wr.set_wr_rdma(request.rkey, request.remote_address)
        wrs.append(wr)
    for current, following in itertools.pairwise(wrs):
        current.next_wr = following
    return wrs


class PyverbsLayer(VerbsLayer):
    """VerbsLayer on pyverbs; every pyverbs error becomes a VerbsError naming the call."""

    def __init__(self) -> None:
        self.pv = load_pyverbs()
        self._status_names = {
            int(getattr(self.pv.enums, name)): name[len("IBV_WC_"):].lower()
            for name in dir(self.pv.enums)
            if name.startswith("IBV_WC_") and (name.endswith("_ERR") or name == "IBV_WC_SUCCESS")
        }

    def _call(self, what: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except self.pv.pyverbs_error.PyverbsError as exc:
            raise VerbsError(f"{what}: {exc}") from exc

    def device_names(self) -> list[str]:
        devices = self._call("ibv_get_device_list", self.pv.device.get_device_list)
        return [device.name.decode() if isinstance(device.name, bytes) else str(device.name) for device in devices]

    def open_context(self, device: str) -> object:
        return self._call(f"opening {device}", self.pv.device.Context, name=device)

    def query_port(self, context: object, port: int) -> PortAttributes:
        attr = self._call(f"ibv_query_port {port}", context.query_port, port)  # type: ignore[attr-defined]
        e = self.pv.enums
        link = LINK_ETHERNET if attr.link_layer == e.IBV_LINK_LAYER_ETHERNET else LINK_INFINIBAND
        return PortAttributes(int(attr.lid), link, attr.state == e.IBV_PORT_ACTIVE)

    def query_gid(self, context: object, port: int, index: int) -> str:
        return str(self._call(f"ibv_query_gid {port}/{index}", context.query_gid, port, index))  # type: ignore[attr-defined]

    def alloc_pd(self, context: object) -> object:
        return self._call("ibv_alloc_pd", self.pv.pd.PD, context)

    def register_mr(self, pd: object, address: int, length: int) -> tuple[object, MemoryKeys]:
        e = self.pv.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        mr = self._call("ibv_reg_mr", self.pv.mr.MR, pd, length, access, address=address)
        return mr, MemoryKeys(address, length, int(mr.lkey), int(mr.rkey))

    def create_cq(self, context: object, depth: int) -> object:
        return self._call("ibv_create_cq", self.pv.cq.CQ, context, depth, None, None, 0)

    def create_qp(self, pd: object, cq: object, send_depth: int) -> tuple[object, int]:
        e = self.pv.enums
        cap = self.pv.qp.QPCap(max_send_wr=send_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = self.pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        qp = self._call("ibv_create_qp", self.pv.qp.QP, pd, init)
        return qp, int(qp.qp_num)

    def modify_to_init(self, qp: object, port: int) -> None:
        self._call("RESET->INIT", qp.to_init, init_attr(self.pv, port))  # type: ignore[attr-defined]

    def modify_to_rtr(self, qp: object, path: PathAttributes) -> None:
        self._call("INIT->RTR", qp.to_rtr, rtr_attr(self.pv, path))  # type: ignore[attr-defined]

    def modify_to_rts(self, qp: object, send: SendAttributes) -> None:
        self._call("RTR->RTS", qp.to_rts, rts_attr(self.pv, send))  # type: ignore[attr-defined]

    def modify_to_error(self, qp: object) -> None:
        attr = self.pv.qp.QPAttr(qp_state=self.pv.enums.IBV_QPS_ERR)
        self._call("->ERR", qp.modify, attr, self.pv.enums.IBV_QP_STATE)  # type: ignore[attr-defined]

    def post_send(self, qp: object, chain: Sequence[WorkRequest]) -> None:
        wrs = send_chain(self.pv, chain)
        self._call(f"ibv_post_send of {len(wrs)} work requests", qp.post_send, wrs[0])  # type: ignore[attr-defined]

    def poll_cq(self, cq: object, max_entries: int) -> list[Completion]:
        _, wcs = self._call("ibv_poll_cq", cq.poll, max_entries)  # type: ignore[attr-defined]
        success = self.pv.enums.IBV_WC_SUCCESS
        return [
            Completion(int(wc.wr_id), wc.status == success, self._status_names.get(int(wc.status), str(wc.status)))
            for wc in wcs
        ]

    def close(self, handle: object) -> None:
        self._call(f"closing {type(handle).__name__}", handle.close)  # type: ignore[attr-defined]
