"""The MoE layer: router -> dispatch -> experts -> combine (DESIGN.md, "Data flow of one step")."""
