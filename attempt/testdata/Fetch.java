import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

// Fetch prints a URL's status and body with the JDK's HttpClient, which
// ignores the proxy environment variables.
public class Fetch {
    public static void main(String[] args) throws Exception {
        try {
            HttpResponse<String> r = HttpClient.newHttpClient().send(
                HttpRequest.newBuilder(URI.create(args[0])).build(), HttpResponse.BodyHandlers.ofString());
            System.out.print(r.statusCode() + " " + r.body());
        } catch (Exception e) {
            System.out.println("error: " + e);
            System.exit(1);
        }
    }
}
