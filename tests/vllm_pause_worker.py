"""Two ranks push the weights through vllm_server.push_transfer while rank 1 is still sampling (the
next turn of a multi-turn trajectory, an async batch), against a stand-in vLLM server that pauses as
a given release does: 0.32 queues a request that arrives while paused until /resume, 0.33+ refuses
it (HTTP 503). Rank 0 writes what the server saw to argv[1].
    torchrun --nproc_per_node=2 tests/vllm_pause_worker.py OUT.json RELEASE"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from options import vllm_server  # noqa: E402
from plumbing import distributed  # noqa: E402


def serve(release):
    """A server with vLLM's pause semantics of `release`; -> (url, the log of what it did)."""
    log, resumed = [], threading.Event()
    resumed.set()

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body, code=200):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.answer({"data": [{"id": "m"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            path = self.path.split("?")[0]
            if path == "/pause":
                resumed.clear()
            elif path == "/resume":
                resumed.set()
            elif path.startswith("/v1/") and not resumed.is_set():
                if release != "0.32":  # vllm/v1/engine/async_llm.py: reject_new_requests
                    log.append("refused " + path)
                    return self.answer({"error": {"message": "Generation is paused. Please retry "
                                                  "after it resumes.", "code": 503}}, 503)
                resumed.wait()  # 0.32: queued until resume
            log.append(path)
            if path.startswith("/v1/"):
                return self.answer({"choices": [{"index": 0, "token_ids": [1], "logprobs": None}]})
            self.answer({})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", log


class Transfer:
    def send_weights(self):
        time.sleep(0.5)  # the weights on their way: the server stays paused meanwhile


def main(out_path, release):
    distributed.setup_distributed()
    url, log = serve(release) if distributed.is_main() else (None, None)
    url = distributed.gather_objects(url)[0]
    server = vllm_server.Server(url, 30)
    if distributed.rank() == 1:  # still sampling its last request when rank 0 reaches the push
        time.sleep(1.0)
        vllm_server.server_generate(server, [[1, 2]], {"n": 1})
    vllm_server.push_transfer(Transfer(), server, "v1")
    if distributed.is_main():
        with open(out_path, "w") as f:
            json.dump(log, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
