"""Phase 1, the hidden dimension d (§4.1, App. B.1-B.2). ``search``: high-entropy prompt search
(App. B.1.1); ``sampling``: N samples per prompt into the sparse D x |V| matrix (Alg. 1), checkpointed;
``prune``: greedy NaN pruning to the common set (App. B.1.2, Alg. commonset-prune); ``spectrum``: the
paper's estimator (Alg. commonset-dhat: arctan, windowed slope, saddle/peak) and the robust one;
``pipeline``: the whole phase on any oracle; ``inspect``: interactive spectrum inspection; ``entropy``."""
