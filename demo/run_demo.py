"""The demo: a partner API with published limits, a few hundred calls, and not one 429.

``python -m demo.run_demo [--quick]`` (or ``make demo``) runs on the embedded default (a SQLite
file and the filesystem broker) in a temporary folder of its own, so it never touches your data:

1. migrates, starts the fake partner (20 calls per 2 s in all, 4 at once, 6 per 2 s per tenant),
   sets the matching policies with ``manage.py ratelimit set``, starts ``dispense --loop`` and a
   Celery worker, sends calls across tenants and shows them drain at the partner's pace;
2. the partner then tightens its limit below the policy: 429s arrive, the keys pause, and every
   call still ends done;
3. the partner announces its limit in every answer (the IETF ``RateLimit`` fields) and our policy
   is a hundred times too loose: the limit is learnt from the first answers, nearly no 429s.
4. a bucket-shaped API of the same partner (a burst of 12, then 4 per second, like Shopify's
   leaky bucket) is given a token-bucket policy: the burst goes at once, then the steady rate,
   with zero 429s.

It ends with a summary and exits 0 only if every check passed. Every process it started is
stopped at the end, on Ctrl-C and on SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.processes import Processes, clean_environment, install_stop_signals, wait_until
from support.windows import max_in_window  # noqa: F401 - re-exported for callers

TENANTS = {"acme": 3, "globex": 2, "initech": 2, "umbrella": 2, "hooli": 1, "stark": 1}
LIMIT, PERIOD, CONCURRENCY, TENANT_LIMIT = 20, 2.0, 4, 6
TIGHTENED_LIMIT = 3
# The limiter counts starts; the partner counts arrivals, a few milliseconds to a few hundred
# later. A policy period longer than the partner's by the worst start-to-arrival delay keeps
# every window the partner sees within its limit.
MARGIN = 0.5
POLICY_PER = f"{round((PERIOD + MARGIN) * 1000)}ms"


@dataclass
class Check:
    what: str
    ok: bool


@dataclass
class PartResult:
    title: str
    sent: int
    elapsed: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    served: int = 0
    rejected_429: int = 0
    peak: int = 0
    peak_served: int = 0
    tenant_peak: int = 0
    max_in_flight: int = 0
    deferrals: int = 0
    limit: int = LIMIT
    tenant_limit: int | None = TENANT_LIMIT  # None: the partner does not limit tenants in this part
    checks: list[Check] = field(default_factory=list)
    shape: str = "window"


class Partner:
    """The fake partner, run as a child process, seen through its control endpoints."""

    def __init__(self, url: str) -> None:
        self.url = url

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/_fake/stats", timeout=5) as response:
            return json.load(response)

    def set_limits(self, **changes: Any) -> None:
        request = urllib.request.Request(
            f"{self.url}/_fake/limits", data=json.dumps(changes).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            response.read()


class View:
    """Live progress: redrawn in place on a terminal, plain lines every few seconds otherwise."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.drawn = 0
        self.last_plain = 0.0

    def show(self, lines: list[str], force: bool = False) -> None:
        if self.tty:
            if self.drawn:
                self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
            self.stream.write("\n".join(lines) + "\n")
            self.drawn = len(lines)
        elif force or time.monotonic() - self.last_plain >= 3:
            self.stream.write(lines[0] + "\n")
            self.last_plain = time.monotonic()
        self.stream.flush()

    def done(self) -> None:
        self.drawn = 0

    def say(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


def progress_lines(title: str, ids: range, partner: dict[str, Any], since: float, elapsed: float) -> tuple[list[str], int]:
    """Return the progress view of one part and how many of its calls are finished."""
    from django.utils import timezone

    from dispatcher.keys import parse_key_set
    from dispatcher.models import CallQueue, KeyState

    calls = CallQueue.objects.filter(id__gte=ids.start, id__lt=ids.stop)
    statuses = Counter(dict(calls.values_list("status").annotate(n=_count()).values_list("status", "n")))
    finished = statuses["done"] + statuses["failed"] + statuses["cancelled"]
    now = time.time()
    mine = [(at, tenant, status) for at, tenant, status in partner["arrivals"] if at >= since]
    window = [at for at, _, status in mine if at > now - partner["limits"]["period"]]
    rejected = sum(1 for *_, status in mine if status == 429)
    total = ids.stop - ids.start
    width = 30
    bar = "#" * int(width * finished / total) + "." * (width - int(width * finished / total))
    lines = [
        f"{title}: [{bar}] {statuses['done']}/{total} done  failed {statuses['failed']}  "
        f"rate {len(window)}/{partner['limits']['limit']} per {partner['limits']['period']:g}s  "
        f"429s {rejected}  {elapsed:4.1f}s",
    ]
    waiting: Counter = Counter()
    for text, n in calls.filter(status__in=["pending", "dispatched"]).values_list("key_set").annotate(n=_count()).values_list("key_set", "n"):
        for key in parse_key_set(text):
            waiting[key] += n
    paused = dict(
        KeyState.objects.filter(paused_until__gt=timezone.now()).values_list("key", "paused_until")
    )
    cells = []
    for key, n in sorted(waiting.items(), key=lambda item: (-item[1], item[0])):
        mark = " (paused)" if key in paused else ""
        cells.append(f"{key} {n}{mark}")
    lines.append("  waiting: " + (", ".join(cells) if cells else "none"))
    return lines, finished


def _count():
    from django.db.models import Count

    return Count("id")


def run_part(
    title: str, partner: Partner, view: View, tenants: list[str], url: str, timeout: float, limit: int,
    keys: list[str] | None = None,
) -> PartResult:
    """Send one call per tenant entry, then show progress until all are finished; return the figures."""
    from django.db import transaction

    from dispatcher.models import CallQueue

    since = time.time()
    started = time.monotonic()
    specs = [
        {
            "method": "http",
            "params": {
                "method": "POST", "url": f"{url}/v1/messages", "headers": {"X-Tenant": tenant},
                "json": {"tenant": tenant, "n": n},
            },
            "keys": keys or ["partner", f"partner:{tenant}"],
        }
        for n, tenant in enumerate(tenants)
    ]
    with transaction.atomic():
        created = CallQueue.objects.send_many(specs)
    ids = range(min(c.id for c in created), max(c.id for c in created) + 1)
    view.say(f"{title}: sent {len(created)} calls for {len(set(tenants))} tenants")
    deadline = started + timeout
    finished = 0
    while time.monotonic() < deadline:
        lines, finished = progress_lines(title, ids, partner.stats(), since, time.monotonic() - started)
        view.show(lines)
        if finished >= len(created):
            break
        time.sleep(0.5)
    view.show(progress_lines(title, ids, partner.stats(), since, time.monotonic() - started)[0], force=True)
    view.done()
    result = PartResult(title=title, sent=len(created), elapsed=time.monotonic() - started, limit=limit)
    calls = CallQueue.objects.filter(id__gte=ids.start, id__lt=ids.stop)
    result.statuses = dict(calls.values_list("status").annotate(n=_count()).values_list("status", "n"))
    result.deferrals = sum(calls.values_list("deferrals", flat=True))
    stats = partner.stats()
    mine = [(at, tenant, status) for at, tenant, status in stats["arrivals"] if at >= since]
    period = stats["limits"]["period"]
    result.served = sum(1 for *_, s in mine if s != 429)
    result.rejected_429 = len(mine) - result.served
    result.peak = max_in_window([at for at, *_ in mine], period)
    result.peak_served = max_in_window([at for at, _, s in mine if s != 429], period)
    by_tenant: dict[str, list[float]] = {}
    for at, tenant, status in mine:
        if status != 429:
            by_tenant.setdefault(tenant, []).append(at)
    result.tenant_peak = max((max_in_window(times, period) for times in by_tenant.values()), default=0)
    result.max_in_flight = stats["max_in_flight"]
    return result


ANNOUNCED_LIMIT = 8


def run_learning_part(procs: Processes, partner: Partner, view: View, url: str, calls: int, quick: bool) -> PartResult:
    """Part 3: the partner announces its limit; our policy is 100x too loose; the limit is learnt."""
    loose = ("ratelimit", "set", "announced", "--limit", str(ANNOUNCED_LIMIT * 100), "--per", f"{PERIOD:g}s")
    view.say(
        f"part 3: the partner allows {ANNOUNCED_LIMIT} per {PERIOD:g}s and says so in every answer "
        "(RateLimit-Policy / RateLimit); our policy is 100x too loose"
    )
    view.say("$ python manage.py " + " ".join(loose))
    procs.manage(*loose)
    partner.set_limits(limit=ANNOUNCED_LIMIT, tenant_limit=10_000, concurrency=10_000, announce=1)
    part = run_part(
        "part 3", partner, view, ["acme"] * calls, url, timeout=90 if quick else 120, limit=ANNOUNCED_LIMIT,
        keys=["announced"],
    )
    from dispatcher.models import LearntLimit

    part.tenant_limit = None
    learnt = ", ".join(str(row) for row in LearntLimit.objects.filter(key="announced")) or "nothing"
    view.say(f"  learnt: {learnt}")
    part.checks = [
        Check(f"every call done ({part.statuses.get('done', 0)}/{part.sent})", part.statuses.get("done", 0) == part.sent),
        Check(f"nearly no 429s ({part.rejected_429} <= 5)", part.rejected_429 <= 5),
        Check(f"served peak within the announced limit ({part.peak_served} <= {ANNOUNCED_LIMIT})",
              part.peak_served <= ANNOUNCED_LIMIT),
        Check(f"the limit was learnt ({learnt})", learnt != "nothing"),
    ]
    return part


BUCKET_RATE, BUCKET_BURST = 4, 12
# The demo runs on SQLite and the filesystem broker on a machine it shares with its partner:
# its start-to-arrival spread is far wider than on PostgreSQL (see docs/policies.md).
DEMO_GUARD = "250ms"


def run_bucket_part(partner: Partner, view: View, url: str, count: int, timeout: float) -> PartResult:
    """Send calls to the partner's bucket-shaped API under a token-bucket policy; return the figures."""
    from dispatcher.models import CallQueue

    title = "part 4"
    since = time.time()
    started = time.monotonic()
    created = CallQueue.objects.send_many([
        {"method": "http", "params": {"method": "POST", "url": f"{url}/v2/orders", "json": {"n": n}}, "keys": ["shop"]}
        for n in range(count)
    ])
    ids = [c.id for c in created]
    view.say(f"{title}: sent {count} calls to the bucket-shaped API")
    calls = CallQueue.objects.filter(id__in=ids)
    while time.monotonic() - started < timeout:
        done = calls.filter(status__in=CallQueue.FINISHED).count()
        served = sum(1 for at, status in partner.stats()["bucket_arrivals"] if at >= since and status == 200)
        view.show([f"{title}: {done}/{count} done, {served} served by the bucket, {time.monotonic() - started:4.1f}s"])
        if done >= count:
            break
        time.sleep(0.5)
    view.done()
    result = PartResult(title=title, sent=count, elapsed=time.monotonic() - started, limit=BUCKET_BURST, shape="bucket")
    result.statuses = dict(calls.values_list("status").annotate(n=_count()).values_list("status", "n"))
    mine = [(at, status) for at, status in partner.stats()["bucket_arrivals"] if at >= since]
    served = sorted(at for at, status in mine if status == 200)
    result.served, result.rejected_429 = len(served), len(mine) - len(served)
    # The least time the bucket allows for these calls: the burst at once, then one per 1/rate.
    ideal = max(len(served) - BUCKET_BURST, 0) / BUCKET_RATE
    span = served[-1] - served[0] if len(served) > 1 else 0.0
    used = ideal / span if span > 0 else 1.0
    burst_first = sum(1 for at in served if at - served[0] <= 1.0) if served else 0
    result.checks = [
        Check(f"every call done ({result.statuses.get('done', 0)}/{count})", result.statuses.get("done", 0) == count),
        Check(f"zero 429s from the bucket ({result.rejected_429})", result.rejected_429 == 0),
        Check(f"the burst went at once ({burst_first} in the first second, burst {BUCKET_BURST})",
              burst_first >= BUCKET_BURST - 2),
        Check(f"then the steady rate: {used:.0%} of what the bucket allows", used >= 0.8),
    ]
    return result


def tenant_mix(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names, weights = zip(*TENANTS.items(), strict=True)
    return rng.choices(names, weights=weights, k=count)


def summary(parts: list[PartResult], total_elapsed: float) -> list[str]:
    lines = ["", "Summary"]
    for part in parts:
        if part.shape == "bucket":
            lines += [
                f"  {part.title}: {part.sent} calls, {part.statuses.get('done', 0)} done, in {part.elapsed:.1f}s",
                f"    the bucket served {part.served}; 429 answers: {part.rejected_429}",
            ]
            lines += [f"    [{'ok' if c.ok else 'FAILED'}] {c.what}" for c in part.checks]
            continue
        lines += [
            f"  {part.title}: {part.sent} calls, {part.statuses.get('done', 0)} done, "
            f"{part.statuses.get('failed', 0)} failed, in {part.elapsed:.1f}s",
            f"    the partner saw: peak {part.peak} requests in any {PERIOD:g}s window "
            f"(its limit {part.limit}; served peak {part.peak_served})"
            + (
                f", busiest tenant {part.tenant_peak} per {PERIOD:g}s (limit {part.tenant_limit}), "
                f"at most {part.max_in_flight} at once (limit {CONCURRENCY})"
                if part.tenant_limit is not None else ""
            ),
            f"    429 answers: {part.rejected_429}; calls deferred by a 429 and retried: {part.deferrals}",
        ]
        for check in part.checks:
            lines.append(f"    [{'ok' if check.ok else 'FAILED'}] {check.what}")
    lines.append(f"  elapsed {total_elapsed:.1f}s")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show the dispatcher keeping a partner API's limits.")
    parser.add_argument("--quick", action="store_true", help="fewer calls (for the tests)")
    parser.add_argument("--calls", type=int, default=None, help="calls in part one (default 160, quick 60)")
    parser.add_argument("--keep", action="store_true", help="keep the demo's folder (database, logs)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the summary as JSON here")
    args = parser.parse_args(argv)
    calls_one = args.calls or (60 if args.quick else 160)
    calls_two = max(20, calls_one // 5)
    if calls_one < 1:
        parser.error("--calls must be at least 1")

    out = sys.stdout
    view = View(out)
    work = Path(tempfile.mkdtemp(prefix="dispatcher-demo-"))
    env = clean_environment({
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DISPATCHER_VAR_DIR": str(work),
        "DATABASE_URL": f"sqlite:///{work / 'db.sqlite3'}",
        "CELERY_BROKER_URL": "filesystem://",
        "EMBEDDED_BROKER_DIR": str(work / "broker"),
        "DISPATCHER_HTTP_ALLOWED_HOSTS": "127.0.0.1:*",  # the fake partner listens on a port the OS picks
        # SQLite has no LISTEN/NOTIFY: the dispenser polls, so poll often.
        "DISPATCHER_POLL_INTERVAL": "100ms",
        "DISPATCHER_ARRIVAL_GUARD": DEMO_GUARD,
        "DISPATCHER_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
    })
    procs = Processes(env, log_dir=work)
    restore = install_stop_signals()
    began = time.monotonic()
    parts: list[PartResult] = []
    code = 1
    try:
        view.say(f"dispatcher demo: embedded SQLite + filesystem broker in {work}")
        result = procs.manage("migrate", "--noinput")
        if result.returncode != 0:
            view.say(result.stdout + result.stderr)
            return 1
        partner_proc = procs.start(
            "partner", sys.executable, "-m", "support.fakeapi", "--limit", str(LIMIT), "--per", str(PERIOD),
            "--concurrency", str(CONCURRENCY), "--tenant-limit", str(TENANT_LIMIT),
        )
        log = work / "partner.log"
        if not wait_until(lambda: "listening on" in log.read_text(), 20):
            view.say("the fake partner did not start")
            return 1
        url = log.read_text().split("listening on", 1)[1].split()[0]
        partner = Partner(url)
        view.say(
            f"partner API at {url}: {LIMIT} calls per {PERIOD:g}s, {CONCURRENCY} at once, "
            f"{TENANT_LIMIT} per {PERIOD:g}s per tenant; 429 + Retry-After beyond that"
        )
        view.say(f"policies: the same limits over {POLICY_PER}, {MARGIN:g}s of headroom for start-to-arrival delay")
        for command in (
            ("ratelimit", "set", "partner", "--limit", str(LIMIT), "--per", POLICY_PER, "--concurrency", str(CONCURRENCY)),
            ("ratelimit", "set", "partner:*", "--limit", str(TENANT_LIMIT), "--per", POLICY_PER),
            ("ratelimit", "set", "shop", "--limit", str(BUCKET_RATE), "--per", "1s", "--burst", str(BUCKET_BURST)),
        ):
            view.say("$ python manage.py " + " ".join(command))
            result = procs.manage(*command)
            if result.returncode != 0:
                view.say(result.stdout + result.stderr)
                return 1
        procs.start("dispenser", sys.executable, "manage.py", "dispense", "--loop")
        procs.start(
            "worker", sys.executable, "-m", "celery", "-A", "project", "worker", "-c", str(CONCURRENCY + 2),
            "-l", "info", "--without-mingle", "--without-gossip", "--without-heartbeat", "-n", "demo@%h",
        )
        view.say("started: dispense --loop, celery worker; waiting for the worker to be ready")
        if not wait_until(lambda: "ready." in (work / "worker.log").read_text(errors="replace"), 60):
            view.say("the worker did not get ready:\n" + (work / "worker.log").read_text(errors="replace")[-3000:])
            return 1

        os.environ.update(env)
        import django

        django.setup()

        one = run_part(
            "part 1", partner, view, tenant_mix(calls_one, 1), url, timeout=150 if not args.quick else 90, limit=LIMIT
        )
        one.checks = [
            Check(f"every call done ({one.statuses.get('done', 0)}/{one.sent})", one.statuses.get("done", 0) == one.sent),
            Check(f"peak at the partner within its limit ({one.peak} <= {LIMIT} per {PERIOD:g}s)", one.peak <= LIMIT),
            Check(f"busiest tenant within its limit ({one.tenant_peak} <= {TENANT_LIMIT})", one.tenant_peak <= TENANT_LIMIT),
            Check(f"at most {CONCURRENCY} at once ({one.max_in_flight})", one.max_in_flight <= CONCURRENCY),
            Check(f"zero 429s ({one.rejected_429})", one.rejected_429 == 0),
        ]
        parts.append(one)

        view.say("")
        view.say(
            f"part 2: the partner tightens to {TIGHTENED_LIMIT} per {PERIOD:g}s; our policy still says {LIMIT}"
        )
        partner.set_limits(limit=TIGHTENED_LIMIT)
        two = run_part(
            "part 2", partner, view, tenant_mix(calls_two, 2), url, timeout=120 if not args.quick else 90,
            limit=TIGHTENED_LIMIT,
        )
        two.checks = [
            Check(f"every call done ({two.statuses.get('done', 0)}/{two.sent})", two.statuses.get("done", 0) == two.sent),
            Check(f"no call failed ({two.statuses.get('failed', 0)})", two.statuses.get("failed", 0) == 0),
            Check(f"429s arrived and were absorbed ({two.rejected_429})", two.rejected_429 > 0),
            Check(
                f"served peak within the new limit ({two.peak_served} <= {TIGHTENED_LIMIT})",
                two.peak_served <= TIGHTENED_LIMIT,
            ),
        ]
        parts.append(two)
        fix = f"python manage.py ratelimit set partner --limit {TIGHTENED_LIMIT} --per {POLICY_PER} --concurrency {CONCURRENCY}"
        if args.keep:
            # The demo's database outlives it only with --keep: name it then, and only then.
            view.say(f"  fix for good without a deploy (this demo's kept database): DATABASE_URL=sqlite:///{work / 'db.sqlite3'} {fix}")
        else:
            view.say(f"  fix for good without a deploy, in your site: {fix}")
        view.say("")
        parts.append(run_learning_part(procs, partner, view, url, calls_two * 2, args.quick))
        view.say("")
        view.say(
            f"part 4: the partner's bucket-shaped API (burst {BUCKET_BURST}, then {BUCKET_RATE} per second),"
            f" policy --limit {BUCKET_RATE} --per 1s --burst {BUCKET_BURST}"
        )
        parts.append(run_bucket_part(partner, view, url, 40 if not args.quick else 28, timeout=90))
        dead = [(name, rc) for name, rc in procs.exited() if name != "partner" or partner_proc.poll() is not None]
        elapsed = time.monotonic() - began
        for line in summary(parts, elapsed):
            view.say(line)
        if dead:
            view.say(f"  [FAILED] processes ended early: {dead}")
        passed = all(c.ok for p in parts for c in p.checks) and not dead
        if args.json_path:
            Path(args.json_path).write_text(json.dumps({
                "passed": passed, "elapsed": elapsed,
                "parts": [{**vars(p), "checks": [vars(c) for c in p.checks]} for p in parts],
            }, indent=2))
        view.say("demo passed" if passed else f"demo FAILED (logs kept in {work})")
        code = 0 if passed else 1
        return code
    except KeyboardInterrupt:
        view.say("\ninterrupted; stopping every process the demo started")
        return 130
    finally:
        procs.stop_all()
        restore()
        if code == 0 and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            view.say(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
