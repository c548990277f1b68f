"""The `dresd` command, one module per subcommand (as `vllm/entrypoints/cli/` is laid out).

    main.py         `main`: the parser, and how a failure is reported
    options.py      option groups several commands share (model, sampling, drafters, dtype,
                    device, threads, Ray, --save-outputs) and the checks of their values
    generate.py     dresd generate        bench.py        dresd bench
    calibrate.py    dresd calibrate       fetch_model.py  dresd fetch-model
    build.py        dresd build (and --append)
    corpus.py       dresd corpus regenerate
    inspect.py      dresd inspect         serve.py        dresd serve

Each command module has `add_parser(commands)`, which adds its subparser and sets the function
that runs it. `python -m dresd.cli` is the command too (`__main__.py`).
"""
