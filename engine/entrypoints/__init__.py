"""How people run specserve: the `specserve` command line (cli, the subcommand
registry in commands, one module per subcommand) and the offline `LLM` class."""
