"""A draft model cut from a GGUF model: its first `--head` and last `--tail` transformer
blocks (renumbered), with the same embeddings, final norm, output head and tokenizer —
self-speculation by layer skipping, for `--spec draft` where no smaller model with the
same tokenizer is at hand.

    python3 scripts/make_layer_draft.py MODEL.gguf DRAFT.gguf --head 6 --tail 2
"""
import argparse
import re

import gguf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--head", type=int, required=True)
    ap.add_argument("--tail", type=int, default=0)
    args = ap.parse_args()
    r = gguf.GGUFReader(args.model)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    num_blocks = int(r.fields[f"{arch}.block_count"].parts[-1][0])
    keep = list(range(args.head)) + list(range(num_blocks - args.tail, num_blocks))
    if len(set(keep)) != len(keep) or not keep:
        raise SystemExit(f"--head {args.head} --tail {args.tail} do not fit {num_blocks} blocks")
    renumber = {old: new for new, old in enumerate(keep)}
    w = gguf.GGUFWriter(args.out, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            w.add_uint32(name, len(keep))
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            w.add_array(name, value)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(field.parts[-1]).decode("utf-8", "replace"))
        else:
            w.add_key_value(name, field.parts[-1].tolist()[0], kind)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m:
            old = int(m.group(1))
            if old not in renumber:
                continue
            name = f"blk.{renumber[old]}.{m.group(2)}"
        else:
            name = t.name
        # Quantized data comes as [rows, bytes a row]; the writer turns that back.
        w.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: blocks {keep} of {num_blocks}")


if __name__ == "__main__":
    main()
