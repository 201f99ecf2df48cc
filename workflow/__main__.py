"""`raymill` CLI: maps each command to a library function. Exit codes: 0 ok, 1 failure, 2 usage/config.

Commands that need no cluster (demo-data, verify, --help) import neither Ray nor torch.
The console shows raymill's own lines; Ray's chatter stays in Ray's log files unless --verbose.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

from stages.common import console, storage
from stages.common.config import ConfigError, load_config
from workflow import signals
from workflow.cli_args import build_parser, unread_overrides

__all__ = ["main"]

log = logging.getLogger("raymill")


def _object_store_hint(e: Exception) -> str:
    """s3fs makes a refused request a bare PermissionError('Forbidden') and a missing bucket FileNotFoundError."""
    if isinstance(e, PermissionError) and e.errno is None:
        return ("; the object store refused the request: check its credentials (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY, or the s3.* keys) and the bucket's policy for the s3:// paths given")
    if isinstance(e, FileNotFoundError) and "bucket does not exist" in str(e):
        return "; create the bucket, or fix the s3:// path that names it"
    chain, x = [], e  # botocore's errors by name (its import is not this module's to pay), raised
    while x is not None and len(chain) < 8:  # here or under a stage's error (a Ray task's, in its text)
        chain.append(f"{type(x).__name__}: {x}")
        x = x.__cause__ or x.__context__
    said = " ".join(chain)
    if "NoCredentialsError" in said:
        return ("; no S3 credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                "or run where an instance role provides them")
    if "EndpointConnectionError" in said:
        return ("; the S3 endpoint does not answer: check s3.endpoint_url (or AWS_ENDPOINT_URL) and the network; "
                "s3.max_attempts bounds the retries before this error")
    return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console.setup(args.verbose)
    if said := unread_overrides(args):
        log.warning("%s", said)
    _loopback_if_local(args)
    # Python's own handler only: a background job (nohup, `&`) inherits SIGINT ignored, and keeps it so
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signals.first_interrupt)
    signals.TERMINATED.clear()
    if argv is None:  # the command itself, not a caller of main([...]): SIGTERM as Ctrl-C, once Ray is up
        from stages.common import ray_start

        signals.CLI.append(True)
        ray_start.AFTER_START.append(signals.take_sigterm)  # whichever command starts Ray
    try:
        return _command(args)
    finally:
        if (tracking := sys.modules.get("stages.common.tracking")) is not None:
            tracking.settle()  # a run that failed early leaves no half-created MLflow store
        console.before_exit()
        if argv is None and signal.getsignal(signal.SIGINT) in (signals.first_interrupt, signals.second_interrupt):
            # The process's command has ended (its output published, or its error said); Ray's own
            # shutdown at exit follows. A Ctrl-C there had printed a traceback from Ray's atexit hook,
            # exit 0, and left Ray's agents running for a minute: the teardown (seconds) finishes
            # instead. Only as the CLI (argv from sys.argv): a caller of main([...]) keeps its handler.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if signal.getsignal(signal.SIGTERM) is signals.terminate:  # nor a KeyboardInterrupt in Ray's atexit hook
                signal.signal(signal.SIGTERM, lambda *_: os._exit(143))


def _command(args) -> int:
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:  # includes bad inputs/outputs named on the command line
        print(f"raymill {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if signal.getsignal(signal.SIGINT) is signals.first_interrupt:  # restored by a fit that caught the first one
            signal.signal(signal.SIGINT, signals.second_interrupt)
        console.worker_lines_first()  # an epoch line in flight had followed this one
        said = "terminated (SIGTERM)" if signals.TERMINATED else "interrupted"
        print(f"raymill {args.command}: {said}{f'; {e}' if str(e) else ''}", file=sys.stderr)
        return 143 if signals.TERMINATED else 130
    except Exception as e:  # the message carries the fix; --verbose adds the traceback
        log.debug("traceback", exc_info=True)
        hint = _object_store_hint(e) + ("" if args.verbose else " (--verbose shows the traceback)")
        print(f"raymill {args.command}: failed: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return 1


def cmd_demo_data(args) -> int:
    from workflow import demo_data

    try:
        info = demo_data.generate(args.out, images=args.images, seed=args.seed)
    except ValueError as e:  # the arguments' checks (demo_data._check_args): a usage error
        raise ConfigError(str(e).replace("pass images >=", "pass --images >=")
                          .replace(" or lower classes", "")) from None
    same = info["images"] - info["written"]
    kept = f" ({same} of them already there, unchanged)" if same else ""
    print(f"demo-data: {info['images']} images in {len(info['classes'])} classes in {info['out']}{kept}")
    return 0


def cmd_etl(args) -> int:
    overrides = list(args.overrides)
    if args.format:
        fmts = "[parquet,tar]" if args.format == "both" else f"[{args.format}]"
        overrides.append(f"etl.formats={fmts}")
    cfg = load_config(args.config, overrides)
    from stages import etl
    from stages.common import session
    from stages.common.locks import output_lock

    with output_lock(args.output, "etl", cfg.s3):  # before Ray: a locked output is refused at once
        etl.preflight(args.input, args.output, cfg.s3, args.overwrite)  # so is a used one
        etl.check_output(args.output, cfg.s3, args.overwrite)  # and one that holds other files
        listing = etl.discover(args.input, cfg.s3, cfg.etl.follow_symlinks, cfg.etl.layout)  # and no images
        session.start(cfg.ray)
        artifact = etl.run(cfg.etl, args.input, args.output, s3=cfg.s3, overwrite=args.overwrite, listing=listing)
    t = artifact.manifest["totals"]  # the stage has logged its full summary: stdout says where it went
    print(f"etl: files_in={t['files_in']} rows_out={t['rows_out']} quarantined={t['quarantined']} -> {artifact.path}")
    return 0


def cmd_verify(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from stages import etl
    from stages.common.artifacts import manifest_kind
    from stages.etl import integrity

    fs, root = storage.filesystem(args.dst, cfg.s3)
    if not fs.exists(root):  # a wrong path is a usage error; an unpublished folder is a problem found
        raise ConfigError(f"'{args.dst}' does not exist; pass an ETL output folder")
    if (kind := manifest_kind(fs, root)) not in (None, "raymill.etl"):
        raise ConfigError(f"'{args.dst}' holds a {kind} output; `raymill verify` checks an ETL output folder")
    if not fs.exists(storage.join(root, storage.MANIFEST)):  # a manifest not raymill's: verify says so
        if not fs.exists(storage.join(root, "shards")):  # an image folder, say: a usage error (it had
            # failed with exit 1, FileNotFoundError); shards without a manifest are a problem found
            raise ConfigError(f"'{args.dst}' is no ETL output (no manifest.json, no shards/); pass the folder "
                              "`raymill etl --output` wrote")
        print(f"verify: FAILED: '{args.dst}' holds shards but no manifest.json: an ETL run that did not publish "
              "(killed, or still running); run the same `raymill etl` again")
        return 1
    problems = etl.verify(args.dst, cfg.s3)
    for line in problems:
        print(f"verify: {line}")
    if unnamed := integrity.unnamed_run_files(args.dst, cfg.s3):  # a note: the dataset itself is whole
        print(f"verify: note: {len(unnamed)} file(s) of killed runs that no manifest names (e.g. {unnamed[0]}): a "
              f"folder read counts their rows; the next `raymill etl --overwrite` on this output removes them")
    print(f"verify: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'ok'} ({args.dst})")
    return 1 if problems else 0


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from stages import train
    from stages.common import tracking
    from stages.common.artifacts import load_input
    from workflow import preflight

    data = load_input(args.data, "etl", cfg.s3)
    with preflight.locked_before_ray(cfg, data, args.output, args.overwrite, "train", [cfg.train.model]):
        artifact = tracking.train(cfg, data, args.output, lambda run: train.run(
            cfg.train, data, args.output, seed=cfg.run.seed, ray_cfg=cfg.ray, s3=cfg.s3, overwrite=args.overwrite,
            tracking=run), reuse=lambda: None if args.overwrite else train.published(
            cfg.train, data, args.output, cfg.run.seed, cfg.s3))
    print(f"train: test_acc={console.score(artifact.manifest['metrics']['test_acc'])} -> {artifact.path}")
    return 0


def cmd_tune(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from stages import tune
    from stages.common import tracking
    from stages.common.artifacts import load_input
    from stages.tune.checks import check_room, check_search
    from workflow import preflight

    check_search(cfg.tune, cfg.train)  # before Ray
    check_room(cfg.tune, cfg.train, cfg.ray)
    data = load_input(args.data, "etl", cfg.s3)
    with preflight.locked_before_ray(cfg, data, args.output, False, "tune", cfg.tune.models(cfg.train.model)):
        artifact = tracking.tune(cfg, data, args.output, lambda callbacks: tune.run(
            cfg.tune, cfg.train, data, args.output, seed=cfg.run.seed, ray_cfg=cfg.ray, s3=cfg.s3,
            callbacks=callbacks), reuse=lambda: tune.published(cfg.tune, cfg.train, data, args.output,
                                                               cfg.run.seed, cfg.s3))
    print(f"tune: {_pairs(artifact.manifest['metrics'])} -> {artifact.path}")
    return 0


def cmd_infer(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from stages import infer
    from stages.common import session, tracking
    from stages.common.artifacts import check_model_folder
    from stages.common.locks import output_lock
    from workflow.preflight import warn_unused_read_keys

    # no model.pt: exit 2 at once, as serve (it had been FileNotFoundError, exit 1); the load hashes it
    check_model_folder(args.model, cfg.s3, weights="present")
    warn_unused_read_keys(cfg, args.model, "infer")
    with output_lock(args.output, "infer", cfg.s3):  # before Ray: a locked output is refused at once
        # Ray starts only for a job that needs it: a few hundred images run in this process
        artifact = infer.run(cfg.infer, args.model, args.data, args.output, s3=cfg.s3,
                             start_ray=lambda: session.start(cfg.ray), cpus=cfg.ray.num_cpus)
    tracking.log_infer(cfg, args.model, artifact, own_run=True)  # a child of the model's MLflow run
    print(f"infer: {_pairs(artifact.manifest.get('metrics', {}))} -> {artifact.path}")
    return 0


def _pairs(metrics: dict) -> str:
    """A stage's scalar metrics as `key=value` pairs, every one (a JSON cut at 300 characters had
    ended mid-value: "device_utilisation": 0 for 0.55), floats to 4 significant digits."""
    shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in metrics.items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    quoted = {k: json.dumps(v, ensure_ascii=False) if isinstance(v, str) and (" " in v or not v) else v
              for k, v in shown.items()}  # one token each, "≈" as itself (not \u2248)
    return " ".join(f"{k}={v}" for k, v in quoted.items())


def cmd_serve(args) -> int:
    extra = [f"serve.{k}={v}" for k, v in (("host", args.host), ("port", args.port),
                                            ("num_replicas", args.replicas)) if v is not None]
    cfg = load_config(args.config, list(args.overrides) + extra)
    from stages.common.artifacts import check_model_folder
    from stages.serve import endpoint

    check_model_folder(args.model, cfg.s3, weights=True)  # before Ray and Serve start: a wrong path is exit 2

    if endpoint.endpoint_running(cfg.serve):  # a running `raymill serve`: roll it to the new model
        address, host = (cfg.ray.address, cfg.serve.host) if cfg.ray.address else \
            endpoint.endpoint_ray_address(cfg.serve)
        # Ray 2.60 turns token auth on by default for a local cluster; a client joining it sends
        # the token (~/.ray/auth_token) only in token mode, read when Ray is first imported.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        from stages import serve
        from stages.common import session

        session.start(cfg.ray.model_copy(update={"address": address}))
        url = serve.update(cfg.serve.model_copy(update={"host": host}), args.model, s3=cfg.s3)
        print(f"serve: {url} now serves {args.model} (rolling update done)", flush=True)
        return 0
    endpoint.claim_port(cfg.serve)  # not one still starting (both had bound it); held until the process ends
    endpoint.check_port_free(cfg.serve)  # nor someone else's, refused before Ray
    from stages import serve
    from stages.common import session

    serve.apply_ingress_env(cfg.serve)  # Serve reads its ingress switches when Ray starts
    session.start(cfg.ray)
    # SIGTERM (systemd, Kubernetes, kill) ends it like Ctrl-C, from here: after ray.init, whose core
    # worker installs its own handler (a "*** SIGTERM received" dump, exit 15), and before Serve starts.
    # Ray's node lost, deploying or serving: the same way out, exit 1, saying why
    lost: list[str] = []

    def on_lost(why: str) -> None:
        lost.append(why)
        log.error("serve: %s; port %d no longer answers: start `raymill serve` again", why, cfg.serve.port)
        # a real signal to the main thread: it wakes a sleep or Ray's wait (interrupt_main wakes neither)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1 if lost else 143))
    # a local Ray only: a joined cluster's app lives on without this machine's node
    watch = serve.watch_ray(on_lost) if cfg.ray.address is None else None
    record = endpoint.record_endpoint(cfg.serve)  # before the port answers: a rollout may follow at once
    try:
        url = serve.start(cfg.serve, args.model, s3=cfg.s3, checked=True)  # check_model_folder above
        endpoint.warn_if_exposed(cfg.serve)
        print(f"serve: POST images to {url}/predict, or N at a time to {url}/v2/models/{cfg.serve.model_name}"
              f"/infer (Ctrl-C stops; `raymill serve --model NEW` with the same --port rolls this endpoint to "
              f"NEW)", flush=True)
        while True:
            time.sleep(3600)
    finally:
        if watch is not None:
            watch.set()  # Ray's own teardown is no death
        record.unlink(missing_ok=True)  # first: a rollout must not roll a stopping endpoint
        # Our own Ray: drained, then the app ends with Ray (deleting it first had left the proxy answering
        # plain-text 404s for ~2 s). A shared cluster: our app is drained, then deleted. A lost Ray: neither.
        if cfg.ray.address is not None or not lost:
            (serve.shutdown if cfg.ray.address is not None else serve.drain)(cfg.serve)


def cmd_run(args) -> int:
    started = _process_started()
    overrides = list(args.overrides) + (["run.force=true"] if args.force else [])
    cfg = load_config(args.config, overrides)
    from workflow import preflight

    if args.serve:  # its endpoint comes last: a port someone holds is said now, not after the run
        from stages.serve import endpoint

        endpoint.claim_port(cfg.serve)  # held until the run ends (the kernel drops it then)
        endpoint.check_port_free(cfg.serve)
    from stages.common.locks import output_lock

    with output_lock(cfg.run.dir, "pipeline", cfg.s3):  # one run a run.dir, refused before anything
        inputs = preflight.start(cfg, serve=args.serve)  # checks before the stages' imports; Ray starts when a stage must compute
        from workflow import pipeline, report

        summary = report.summary(pipeline.run(cfg, serve=args.serve, inputs=inputs, started=started))
    if (ray := sys.modules.get("ray")) is not None and ray.is_initialized():  # a stage computed: flush
        ray.shutdown()  # Ray's last worker lines now, so the summary is the last thing printed
    print(summary, flush=True)  # stdout holds the summary only: no leading blank line
    return 0


def _process_started() -> float:
    """This process's start on the perf_counter clock: the report's total counts Python's start and
    imports too. On Linux its age comes from the kernel's clock since boot (/proc): psutil's
    create_time adds the boot time as recorded, which drifts from time.time() (1.0 s on this VM)
    and had made every run's total a second long."""
    try:
        with open("/proc/self/stat") as f:
            ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux
        import psutil

        age = time.time() - psutil.Process().create_time()
    return time.perf_counter() - max(0.0, age)


def cmd_export(args) -> int:
    overrides = list(args.overrides) + ([f"export.format={args.format}"] if args.format else [])
    cfg = load_config(args.config, overrides)
    from stages.model import export
    from workflow.preflight import warn_unused_read_keys

    if args.data:
        warn_unused_read_keys(cfg, args.model, "export --data")
    artifact = export.run(cfg.export, args.model, args.output, name=cfg.export.name or cfg.tracking.model_name,
                          s3=cfg.s3, data=args.data)
    m, check = artifact.manifest, artifact.manifest["check"]
    print(f"export: {m['format']} model '{m['name']}' checked on {check['images']} {check['split']} images: logits "
          f"max |diff| {check['logits_max_abs_diff']:.2e}, class agreement {check['class_agreement']:.3f} "
          f"-> {artifact.path}")
    return 0


def cmd_doctor(args) -> int:
    """Every listening port of this user's Ray processes, classified as tests/test_exposure.py
    does (stages.common.exposure); exit 1 when one is exposed."""
    import psutil

    from stages.common import exposure

    if args.pid and not psutil.pid_exists(args.pid):  # had said "no Ray process of yours is listening", exit 0
        raise ConfigError(f"--pid {args.pid}: no such process on this machine")
    rows = exposure.rows(exposure.process_tree(args.pid) if args.pid else exposure.ray_processes())
    if not rows:
        print(f"doctor: no process under pid {args.pid} is listening" if args.pid else
              "doctor: no Ray process of yours is listening on this machine")
        return 0
    print("| process | pid | address | port | kind | why |\n|---|---:|---|---:|---|---|")
    for r in rows:
        print(f"| {r['process']} | {r['pid']} | {r['address']} | {r['port']} | {r['kind']} | {r['why']} |")
    kinds = [r["kind"] for r in rows]
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("loopback", "ray-grpc-token", "named", "exposed"))
    print(f"doctor: {len(rows)} listeners: {counts}")
    return 1 if "exposed" in kinds else 0


def _loopback_if_local(args) -> None:
    """Before anything imports Ray: a run that starts its own local Ray keeps it on loopback
    (stages.common.session.keep_local_on_loopback), read by Ray when it is imported."""
    if not hasattr(args, "overrides") or os.environ.get("RAY_ADDRESS"):
        return
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError:
        return  # the command itself reports it, with the fix
    if cfg.ray.address is None:
        from stages.common import session  # imports no Ray

        session.keep_local_on_loopback()


COMMANDS = {"demo-data": cmd_demo_data, "etl": cmd_etl, "verify": cmd_verify, "train": cmd_train,
            "tune": cmd_tune, "infer": cmd_infer, "serve": cmd_serve, "run": cmd_run,
            "export": cmd_export, "doctor": cmd_doctor}

if __name__ == "__main__":
    sys.exit(main())
