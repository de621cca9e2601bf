"""The repro scripts' own code, as modules: each is read as script code, not imported to run.

A part's imports become the script's (but shardcheck's: those name what other parts and the
script itself define, declared in :mod:`.script`), the rest of its source the script's code
(:func:`shardcheck.megatron.repro.snippets.part_source`). Written as modules, the parts are
whole Python that the linters and the architecture test read like the rest of the package.
"""
