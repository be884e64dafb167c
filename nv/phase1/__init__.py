"""Phase 1, the hidden dimension d (§4.1, App. B.1-B.2). ``search``: high-entropy prompt search
(App. B.1.1); ``sampling``: N samples per prompt into the sparse D x |V| matrix (Alg. 1 = Alg. commonset-prune, lines 1-5), checkpointed;
``adaptive``: ``sampling.N: auto``, rounds of growing N until the estimate is stable (issue 14);
``prune``: greedy NaN pruning to the common set (App. B.1.2, Alg. 1 lines 6-7); ``spectrum``: the
paper's estimator (Alg. 2 = Alg. commonset-dhat, Eqs. 4-5: arctan, windowed slope, saddle/peak) and the robust one;
``pipeline``: the whole phase on any oracle; ``sweep``: thinned budgets and the detector's interval (§5.2,
Fig. val_plot); ``exactness``: the (D, N, tau) grid of outcomes and tokens to exact (issue 14);
``planner``: the budget from a pilot (§5.2 / App. F's mean mu(N), Theorem 1); ``incomplete``: the missing-data estimator, every observed
entry of the tokens most prompts drew (issue 14, item 3; our extension); ``inspect``: interactive spectrum inspection;
``entropy``: the temperature/entropy card (App. B.1.1)."""
