from twisted.application.service import ServiceMaker

yieldproxy = ServiceMaker(
    "yieldproxy",
    "yieldproxy.tap",
    "Reverse proxy that parks requests while the GPU is yielded",
    "yieldproxy",
)
