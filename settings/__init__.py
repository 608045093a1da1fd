"""The settings tree: every setting of every command and of `LLM(...)`, each defined once (settings/setting.py).

Groups by concern, each a frozen dataclass of `setting(...)` fields: the engine (engine.py: EngineConfig, with the
scheduler's scheduler.py, kv_compact.py, lora.py, speculative.py), a worker (worker.py, fast_paths.py), the
scheduler process (server.py), the processes' shared ones (process.py), the router (router.py), the client-side
tools (tools.py, bench.py). commands.py says which groups each command takes. Derived from the tree: each
command's parser and --help (cli.py), its config-file keys (config_file.py), `LLM(...)`'s keywords
(engine_args.py, build.py), and docs/settings.md (table.py). No torch and no grpc here: both sides read it.
"""
