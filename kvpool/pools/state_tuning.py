"""How the state pool cuts up its row copies (``MambaPool``'s forks). Nothing here changes a result."""

#: Programs per SM of a state fork (the one-pass row copy over the pool's own table): fewer, longer
#: programs than a KV move's grid, whose rows are a few hundred bytes.
STATE_FORK_PROGRAMS_PER_SM = 4
