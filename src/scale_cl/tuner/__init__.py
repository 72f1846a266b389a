"""The SCALE tuner: width upscaling of a transformers causal LM and its three methods (docs/design.md §1, §3).

What ``import scale_cl`` loads, and nothing else: the config (`config`), the sizes a model grows by (`widths`,
`arch/`), the block modules (`layers`, `attention`, `init`), the surgery (`upscale`), the method switch (`modes`),
routing (`routing/`), growing again (`stages`), save and load (`io`, `restore`, `provenance`), a quantized base
(`quant`), the parameter summary (`summary`) and new token rows (`vocab/`). The public names are `scale_cl`'s.
"""
