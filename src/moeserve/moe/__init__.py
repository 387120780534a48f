"""The MoE layer: router -> dispatch -> experts -> combine (docs/DESIGN.md, "One step")."""
