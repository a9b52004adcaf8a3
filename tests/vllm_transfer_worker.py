"""Drive vLLM's own trainer-side NCCL weight-transfer engine (whichever vLLM `import vllm` finds: the
installed one, or a release's Python put first on PYTHONPATH) with the project's weight source, on
the CPU, under torchrun with 2 FSDP2 ranks of a LoRA policy: rank 0 sends, rank 1 joins the gathers
(vLLM's non-sender path). The server side is a thread in rank 0's process that receives as vLLM's
worker engine does (names, dtypes and shapes from update_weights; empty lists: the previous
round's), over gloo instead of NCCL, the engine's CUDA stream a no-op. Two pushes; rank 0 writes a
JSON report to argv[1]: the received weights against lora.hf_full_weights, the client's calls, the
API the source took.
    torchrun --nproc_per_node=2 tests/vllm_transfer_worker.py OUT.json"""

import datetime
import json
import os
import socket
import sys
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from options import lora, vllm_server, weight_source  # noqa: E402
from plumbing import distributed, models  # noqa: E402
from step import data  # noqa: E402


def gloo_pair(rank, port):
    """The transfer group of vLLM's engine as gloo: the sender (0) and one server worker (1)."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))


class GlooCommunicator:
    """PyNcclCommunicator's methods the trainer engine calls, over a gloo group."""

    def __init__(self, group, rank):
        self.group, self.rank, self.device = group, rank, torch.device("cpu")

    def broadcast(self, tensor, src, stream=None):
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()

    def destroy(self):
        pass


class ServerClient:
    """HTTPVLLMWeightSyncClient's calls, answered as a vLLM server's NCCL worker engine would:
    update_weights receives each declared tensor from the group (the previous round's declaration
    where the lists are empty: vLLM >= 0.33 sends them once)."""

    def __init__(self, port):
        self.calls, self.received, self.port, self.last = [], [], port, None
        self.worker = None

    def init_weight_transfer_engine(self, payload):
        self.calls.append("init")
        ready = threading.Event()
        threading.Thread(target=lambda: (setattr(self, "worker", GlooCommunicator(
            gloo_pair(1, self.port), 1)), ready.set())).start()
        self.ready = ready

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update):
        self.ready.wait(60)
        names = update["names"] or self.last["names"]
        self.last = update if update["names"] else self.last
        self.calls.append(("update", len(update["names"])))
        got = {}
        for name, dtype, shape in zip(names, self.last["dtype_names"], self.last["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.worker.broadcast(tensor, src=0)
            got[name] = tensor
        self.received.append(got)

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish")


def main(out_path):
    import vllm
    from vllm.distributed.weight_transfer import nccl_engine

    distributed.setup_distributed()
    cfg = train.parse_config(["--use_peft", "--bf16", "false"])
    model = lora.add_adapter(data.embedded_task(0)[0], lora.settings(cfg))
    for name, p in model.named_parameters():  # an adapter that changes the merge
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    cfg.bf16 = True  # FSDP2 sharding in one process or two; the push in bf16
    model = models.prepare_model(model, cfg, trainable=True)
    port = None
    if distributed.is_main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = distributed.gather_objects(port)[0]
    client = ServerClient(port)
    # the sender's end of the group, CUDA's stream calls as no-ops and tensors one at a time (the
    # packed buckets are CUDA streams): the rest is vLLM's code
    init_info = nccl_engine.NCCLTrainerInitInfo
    nccl_engine.NCCLTrainerInitInfo = lambda **kwargs: init_info(**kwargs, packed=False)
    nccl_engine.open_trainer_endpoint = lambda *args, **kwargs: GlooCommunicator(
        gloo_pair(0, port), 0)
    torch.cuda.current_stream = lambda *args, **kwargs: SimpleNamespace(synchronize=lambda: None)
    cfg.vllm_server_timeout = 60.0
    address, free = "127.0.0.1", port  # nccl_transfer asks the server for its world size
    vllm_server.http = lambda url, *args, **kwargs: {"world_size": 1}
    vllm_server.free_port = lambda: free
    source = weight_source.policy_weights(model, torch.bfloat16)
    transfer = vllm_server.nccl_transfer(source, client, vllm_server.Server(f"http://{address}:1", 60))
    expected = {}
    for round_ in range(2):
        with torch.no_grad():  # the second push must carry new weights
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.01 * (round_ + 1))
        full = {n: t.to(torch.bfloat16).clone() for n, t in lora.hf_full_weights(model,
                                                                               "parameters")}
        expected[round_] = full
        transfer.send_weights()
    transfer.shutdown()
    if distributed.is_main():
        report = {"vllm": vllm.__version__, "api": source.api, "calls": client.calls,
                  "rounds": [{"names": sorted(got), "max_diff": max(
                      (got[n].float() - expected[i][n].float()).abs().max().item() for n in got),
                      "expected": sorted(expected[i])} for i, got in enumerate(client.received)]}
        with open(out_path, "w") as f:
            json.dump(report, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
