"""A real Slurm cluster on this machine for the tests: Debian's munged, slurmctld and two slurmd daemons (nodes n1
and n2, CPU only, both on this host - Debian's build allows several slurmd per host), with their own
configuration, ports and state under a temporary folder. Needs root (the daemons run as root here) and the
packages slurm-wlm and munge (scripts/test.sh installs them)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")


def available() -> str | None:
    """Why a cluster cannot be started here, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm/munge not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root"
    return None


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def _write_conf(self) -> None:
        ctl, d1, d2 = _free_ports(3)
        host = socket.gethostname().split(".")[0]
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""ClusterName=plabtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldPort={ctl}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MpiDefault=none
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
KillWait=5
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={d1} CPUs=2 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={d2} CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")

    def _munge(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return  # a munged runs already
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], check=True, capture_output=True)
        for _ in range(50):
            if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not start")

    def up(self) -> "SlurmCluster":
        self._write_conf()
        self._munge()
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
        for node in ("n1", "n2"):
            self.procs.append(subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(self.conf)], env=self.env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=self.env, capture_output=True, text=True).stdout
            if out.split() == ["idle", "2"]:
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm cluster did not come up: {out!r}\n{self.log()}")

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def scontrol(self, *args: str) -> str:
        proc = subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def down(self) -> None:
        """Jobs cancelled, daemons stopped (killed after 3 s: their state is thrown away with the folder)."""
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
        deadline = time.time() + 30  # let slurmd end the jobs' processes before it goes
        while time.time() < deadline and subprocess.run(["squeue", "-h"], env=self.env, capture_output=True,
                                                         text=True).stdout.strip():
            time.sleep(0.5)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

