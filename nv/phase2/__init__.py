"""Phase 2, depth L and parameter count P from prefill latency (§4.2, App. B.3, App. D). ``protocol``:
the App. D timing protocol (random prefixes, warm-ups, K trials, trimmed means), checkpointed;
``fit``: the scaling relation and its fits (Eqs. 2-10: beta, alpha, gamma_g, k, L_hat; Eq. 3 P_hat; Eq. 11 the sweep's crossover);
``platforms``: the timed models on each platform (in-process torch, llama.cpp server); ``evaluation``:
leave-one-out over every model and platform; ``prefill``: the attacker-side P_hat from the prefill curve;
``intervals``: the significance gate on depth fits, the rule choosing between the two depth estimators and the
calibrated 90 % intervals of L_hat and P_hat (our extension); ``calibration``: the file a new target's phase 2 reads (the references' fits, protocol
and leave-one-out errors); ``live``: phase 2 on an endpoint; ``probe``: the attention probe, L from calls that
extend a cached context (our extension: attention time alone, free of the MLP width that biases Eq. 2's fit)."""
