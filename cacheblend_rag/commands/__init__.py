"""The core subcommands, one module each (`cli.py` builds the parser from their registrars, `REGISTRARS`):

    common.py     argument types, the data and model arguments, opening the engine and the chunk store
    ingest.py     ingest (files, or an existing Chroma collection)
    delete.py     delete and prune
    profile.py    profile (compute and storage profiles, codec choice per tier)
    plan.py       plan (a corpus's KV size per codec and tier)
    calibrate.py  calibrate (the fidelity gate's ratio; Cache-Craft's alpha)
    serve.py      serve's registrar (the server runs it: `serve/command.py`)

Other distributions add theirs through the entry-point group of the same name, `cacheblend_rag.commands`.
"""
