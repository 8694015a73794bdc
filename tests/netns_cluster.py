"""Network namespaces as the nodes of a cluster on one machine (root only), for tests/test_multihost.py.

Each node is a network namespace with a veth pair to a bridge in the root namespace (10.77.0.<i>/24, lo up,
no default route), plus its own PID, UTS and mount namespaces held by one init process: the node's name is
its hostname, /etc/hosts names every node, /proc shows only the node's processes (so `ray stop` on a node
stops only that node's Ray), and /tmp/ray and /dev/shm are the node's own. Killing the init kills everything
on the node at once, like a machine losing power.

    with NetnsCluster() as cluster:            # rl360-n1..3; a stale cluster of the same names is removed first
        env = {"RL360_NODES": " ".join(cluster.nodes), "RL360_ON_NODE": cluster.on_node}
        ...                                    # launchers/slurm/ray_cluster.sh -- COMMAND
        cluster.kill("rl360-n2")

`python tests/netns_cluster.py exec --state DIR NODE COMMAND...` (what `on_node` holds, `{node}` for NODE) runs
COMMAND on NODE the way srun runs a task: inside the node's namespaces, in this directory, signals forwarded,
its exit status returned. `python tests/netns_cluster.py down [--prefix rl360-n]` removes a left-over cluster.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a script (the node runner, RL360_ON_NODE): the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.up_down import UpDown  # noqa: E402

STATE_DIR = Path("/tmp/rl360-netns")
# PID 1 of a node: reaps the orphans Ray's daemons leave, and ends on SIGTERM (PID 1 ignores unhandled signals)
_INIT = ("import os, signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: os._exit(0))\n"
         "print('ready', flush=True)\n"
         "while True:\n"
         "    try:\n"
         "        os.wait()\n"
         "    except ChildProcessError:\n"
         "        time.sleep(0.5)\n")
_NAMESPACES = ("net", "uts", "ipc", "pid", "mnt")  # setns order: mnt last, it changes the root and directory


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetnsCluster(UpDown):
    """`size` nodes named `<prefix><i>` at `<subnet>.<i>`, joined by the bridge `<prefix>br` (root namespace)."""

    def __init__(self, size: int = 3, prefix: str = "rl360-n", subnet: str = "10.77.0", state_dir: Path = STATE_DIR):
        self.prefix, self.subnet = prefix, subnet
        self.nodes = [f"{prefix}{i}" for i in range(1, size + 1)]
        self.addresses = {node: f"{subnet}.{i}" for i, node in enumerate(self.nodes, start=1)}
        self.bridge = f"{prefix}br"
        self.state_dir = Path(state_dir) / prefix
        self._inits: dict[str, subprocess.Popen] = {}

    @property
    def on_node(self) -> str:
        """The runner for RL360_ON_NODE: a command prefix, `{node}` standing for the node."""
        return f"{sys.executable} {Path(__file__).resolve()} exec --state {self.state_dir} {{node}}"

    def up(self) -> None:
        """Make the bridge and the nodes; CalledProcessError (with ip's message) when the kernel refuses."""
        self.down()  # whatever an earlier, killed run of the same names left
        self.state_dir.mkdir(parents=True)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addresses.items())
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for index, node in enumerate(self.nodes, start=1):
            veth = f"{self.prefix}v{index}"
            _ip("netns", "add", node)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", node, "addr", "add", f"{self.addresses[node]}/24", "dev", "eth0")
            _ip("-n", node, "link", "set", "eth0", "up")
            _ip("-n", node, "link", "set", "lo", "up")
            home = self.state_dir / node
            (home / "ray").mkdir(parents=True)
            (home / "hosts").write_text(hosts)
            self._start_init(node, home)

    def _start_init(self, node: str, home: Path) -> None:
        mounts = (f"set -e; hostname {node}; mount --bind {home}/hosts /etc/hosts; mkdir -p /tmp/ray; "
                  f"mount --bind {home}/ray /tmp/ray; mount -t tmpfs rl360-shm /dev/shm; "
                  f'exec {sys.executable} -c "$0"')
        init = subprocess.Popen(["ip", "netns", "exec", node, "unshare", "--pid", "--uts", "--ipc", "--mount",
                                 "--fork", "--mount-proc", "--kill-child", "sh", "-c", mounts, _INIT],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        self._inits[node] = init
        line = init.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"node {node} did not start (init exited with {init.wait()})")
        # the init's PID as the root namespace sees it: the child of unshare (ip netns exec execs unshare)
        children = Path(f"/proc/{init.pid}/task/{init.pid}/children").read_text().split()
        (home / "pid").write_text(children[0])

    def pids(self, node: str) -> list[int]:
        """Every process in the node's network namespace (its init and whatever runs on it)."""
        found = _ip("netns", "pids", node, check=False).stdout.split()
        return [int(pid) for pid in found]

    def processes(self, node: str) -> list[str]:
        """The command lines of the node's processes."""
        lines = []
        for pid in self.pids(node):
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
            except OSError:
                pass
        return lines

    def kill(self, node: str) -> None:
        """SIGKILL everything on `node` at once (its PID namespace ends with its init)."""
        for pid in self.pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        init = self._inits.get(node)
        if init is not None:
            init.wait(timeout=30)

    def down(self) -> None:
        """Kill every node's processes, delete the namespaces and the bridge, remove the state directory."""
        present = set(_ip("netns", "list", check=False).stdout.split())
        for node in self.nodes:
            if node in present:
                self.kill(node)
                deadline = time.monotonic() + 10
                while self.pids(node) and time.monotonic() < deadline:  # SIGKILLed processes take a moment
                    time.sleep(0.1)
                _ip("netns", "del", node, check=False)
        for index in range(1, len(self.nodes) + 1):  # the kernel frees a deleted namespace's links lazily
            _ip("link", "del", f"{self.prefix}v{index}", check=False)
        for init in self._inits.values():
            if init.poll() is None:
                init.kill()
            init.wait()
            init.stdout.close()
        self._inits.clear()
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.state_dir, ignore_errors=True)


def _enter(node: str, state_dir: Path) -> None:
    """Move this process into `node`'s namespaces (its children start in its PID namespace)."""
    init_pid = (state_dir / node / "pid").read_text().strip()
    libc = ctypes.CDLL(None, use_errno=True)
    cwd = os.getcwd()
    for kind in _NAMESPACES:
        fd = os.open(f"/proc/{init_pid}/ns/{kind}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns({kind}) into node {node} failed")
        finally:
            os.close(fd)
    os.chdir(cwd)


def _exec(node: str, command: list[str], state_dir: Path) -> int:
    """Run `command` on `node` as srun runs a task: SIGINT / SIGTERM / SIGHUP / SIGUSR1 / SIGUSR2 go to its process
    group."""
    try:
        _enter(node, state_dir)
    except OSError as err:
        print(f"netns_cluster: cannot enter node {node}: {err}", file=sys.stderr)
        return 255
    child = subprocess.Popen(command, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, forward)
    status = child.wait()
    return status if status >= 0 else 128 - status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    run = commands.add_parser("exec", help="run a command on a node")
    run.add_argument("--state", type=Path, required=True, help="the cluster's state directory")
    run.add_argument("node")
    run.add_argument("command", nargs=argparse.REMAINDER)
    down = commands.add_parser("down", help="remove a left-over cluster")
    down.add_argument("--prefix", default="rl360-n")
    down.add_argument("--size", type=int, default=3)
    args = parser.parse_args(argv)
    if args.action == "exec":
        return _exec(args.node, args.command, args.state)
    NetnsCluster(args.size, args.prefix).down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
