"""Reading and checking a topology: the TOML file and dotted overrides (``load``), the rules
across fields (``checks``), the host table (``hosts``), memory (``capacity``), device layout
(``layout``) and the checks that load user code (``preflight``). The types are the library's
(``actors.runtime.config``)."""
