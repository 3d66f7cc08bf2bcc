package gateway_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/osmo-rl/osmo/gateway"
)

func ExampleNew() {
	// grpc.NewClient connects lazily: nothing is dialed until a call.
	conn, err := grpc.NewClient("127.0.0.1:9090", grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	handler, err := gateway.New(gateway.Config{Rollout: conn, Grader: conn})
	if err != nil {
		log.Fatal(err)
	}

	// gRPC clients need HTTP/2; without TLS that is h2c.
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Addr: ":8080", Handler: handler, Protocols: &protocols, ReadHeaderTimeout: 10 * time.Second}
	_ = srv // srv.ListenAndServe() in a real program

	rec := httptest.NewRecorder()
	handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/openapi.json", nil))
	fmt.Println(rec.Code, rec.Header().Get("Content-Type"))
	// Output: 200 application/json
}
