"""`rl360 serve ...`: HTTP services of our own: a SandboxFusion-compatible code sandbox (`serve sandbox`)
a Hugging Face checkpoint behind the OpenAI API (`serve model`), the rollout engine behind SGLang's
native API (`serve rollout`, `rl360.engine.server`) and the Lewis game's listener (`serve listener`), all on one
service layer (`rl360.service.app`: FastAPI + uvicorn with keys, limits, deadlines, graceful shutdown, `/health`,
`/metrics`)."""


def add_serve_parser(commands) -> None:
    from rl360.engine.server import add_rollout_parser
    from rl360.serve.listener import add_listener_parser
    from rl360.serve.openai_api import add_model_parser
    from rl360.serve.sandbox import add_sandbox_parser

    serve = commands.add_parser("serve", help="run an HTTP service")
    services = serve.add_subparsers(dest="service", required=True)
    add_sandbox_parser(services)
    add_model_parser(services)
    add_rollout_parser(services)
    add_listener_parser(services)
