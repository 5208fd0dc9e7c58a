"""The ceiling: a bare single-process Tornado app that parses a JSON POST and answers
JSON. Nothing the service does can be faster than this on the same machine."""
import json
import sys

import tornado.ioloop
import tornado.web


class Echo(tornado.web.RequestHandler):
    def post(self):
        body = json.loads(self.request.body)
        self.finish({"received": True, "order_name": body["order_name"]})


def main(port):
    app = tornado.web.Application([(r"/echo", Echo)], log_function=lambda handler: None)
    app.listen(port, "127.0.0.1")
    tornado.ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main(int(sys.argv[1]))
